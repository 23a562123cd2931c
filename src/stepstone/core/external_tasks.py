"""Arriving at an external step: the task outside workers fetch, and what the position waits for.

The task's id is derived from the instance, position, step and visit, so every attempt of the
commit that enters the step names the same task, and an operator's retry of a failed position
re-opens it rather than adding a second one. Its completion arrives as an EXTERNAL_COMPLETION
command on the position (`core.external_completion`).
"""

from __future__ import annotations

import uuid

from stepstone.core.effects import Effect, MovePosition, OpenExternalTask, RecordHistory
from stepstone.core.model import JSON, WAITING, InstanceView
from stepstone.core.plan import Step

_TASKS = uuid.UUID("7d3c2a91-5e0b-4f6a-8c1d-3b9e4f2a6d10")


def external_task_id(instance_id: str, position: str, step: str, visit: int) -> str:
    """The task a step visit opens: the same id on every attempt of its commit."""
    return str(uuid.uuid5(_TASKS, f"{instance_id}/{position}/{step}/{visit}"))


def task_payload(step: Step, state: JSON) -> JSON:
    """What workers receive: the whole state, or only the state fields the step names."""
    if step.inputs is None or not isinstance(state, dict):
        return state
    return {name: state[name] for name in step.inputs if name in state}


def open_task(instance: InstanceView, step: Step, visit: int, state: JSON) -> list[Effect]:
    """The position waits at `step` for the completion of the task this visit opens."""
    task = external_task_id(instance.id, instance.position, step.name, visit)
    wait = {"kind": "external", "task_id": task, "topic": step.topic}
    policy = step.retry
    backoff = {"initial": policy.initial_backoff, "multiplier": policy.multiplier, "max": policy.max_backoff}
    return [
        MovePosition(WAITING, step.name, visit, wait=wait),
        RecordHistory("EXTERNAL_TASK_OPENED", step.name, visit, {"task_id": task, "topic": step.topic}),
        OpenExternalTask(task, step.topic or "", step.name, visit, task_payload(step, state), policy.max_attempts,
                         backoff),
    ]
