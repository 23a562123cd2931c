"""The variables an external task completes with must fit the workflow's state model.

The store cannot check them (the HTTP endpoint has no workflow code), so the worker does, before it
commits the EXTERNAL_COMPLETION: state that does not fit fails the position with the model's
complaint instead of being stored; state the model normalises is stored normalised.
"""

from __future__ import annotations

from typing import Any

from stepstone.authoring.workflow import Workflow
from stepstone.core.effects import SetState
from stepstone.core.external_completion import variables_rejected, with_state
from stepstone.core.model import CommandView, Decision, InstanceView
from stepstone.core.patch import same
from stepstone.errors import InvalidInput


def checked(workflow: Workflow[Any], instance: InstanceView, command: CommandView, decision: Decision) -> Decision:
    if command.kind != "EXTERNAL_COMPLETION":
        return decision
    change = decision.first(SetState)
    if change is None:
        return decision
    try:
        state = workflow.state_to_json(change.state, what="the state with the task's variables")
    except InvalidInput as exc:
        return variables_rejected(instance, command, str(exc))
    return decision if same(state, change.state) else with_state(instance, decision, state)
