"""EXTERNAL_COMPLETION: an outside worker's answer to the external task this position waits for.

The store records the answer as a command on the position only while the worker's lock holds
(`store/external.py`), so the command is the one answer of that task. Its payload says what it is:

    completed   the worker's variables are merged into the state (top-level keys), then next[0]
    error       a business error with a code: the step's `errors[code]`, or an incident without one
    failed      the worker failed with no retries left: an incident (the operator retries it)

An answer for a task the position no longer waits for (a cancelled branch, a newer visit) is
recorded and ignored.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from stepstone.core.effects import RecordHistory, SetState, state_change
from stepstone.core.entering import enter, fail, settled
from stepstone.core.model import JSON, WAITING, CommandView, Decision, InstanceView
from stepstone.core.patch import diff
from stepstone.core.plan import Plan


def awaited(instance: InstanceView, command: CommandView) -> bool:
    """Whether this position waits for the task the command answers."""
    wait = instance.wait or {}
    payload = command.payload if isinstance(command.payload, dict) else {}
    return (
        (instance.position_status or instance.status) == WAITING
        and wait.get("kind") == "external"
        and payload.get("task_id") == wait.get("task_id")
        and command.visit == instance.visit
    )


def external_done(instance: InstanceView, command: CommandView, plan: Plan, now: datetime) -> Decision:
    """Apply an awaited task's answer (check `awaited` first)."""
    payload: dict[str, Any] = command.payload
    step = plan.steps[instance.step or ""]
    task = payload.get("task_id")
    worker = payload.get("worker")
    state = _merged(instance.state, payload.get("variables"))
    outcome = payload.get("outcome")
    raw_error = payload.get("error")
    error: dict[str, Any] = raw_error if isinstance(raw_error, dict) else {}
    cause = {"external": {"task_id": task, "outcome": outcome, "error": error or None}}
    if outcome == "completed":
        done = RecordHistory("EXTERNAL_TASK_COMPLETED", step.name, instance.visit,
                             {"task_id": task, "worker": worker, "patch": diff(instance.state, state)})
        entered = enter(instance, plan, step.next[0], state, now, cause=cause)
        return Decision(settled(entered), (done, *state_change(instance.state, state), *entered))
    code, message = str(error.get("code") or ""), str(error.get("message") or "")
    if outcome == "error":
        raised = RecordHistory("EXTERNAL_TASK_ERROR", step.name, instance.visit,
                               {"task_id": task, "worker": worker, "code": code, "message": message})
        target = step.errors.get(code)
        if target is not None:
            entered = enter(instance, plan, target, state, now, cause=cause)
            return Decision(settled(entered), (raised, *state_change(instance.state, state), *entered))
        effects = fail(instance, "ExternalTaskError",
                       f"external task {task} raised business error {code!r}, which step {step.name!r} does not "
                       f"handle: {message}", step=step.name)
        return Decision(settled(effects), (raised, *effects))
    failed = RecordHistory("EXTERNAL_TASK_FAILED", step.name, instance.visit,
                           {"task_id": task, "worker": worker, "message": message, "attempts": payload.get("attempts")})
    effects = fail(instance, "ExternalTaskFailed",
                   f"external task {task} on topic {step.topic!r} failed with no retries left: {message}",
                   step=step.name)
    return Decision(settled(effects), (failed, *effects))


def _merged(state: JSON, variables: JSON) -> JSON:
    if not isinstance(variables, dict) or not variables or not isinstance(state, dict):
        return state
    return {**state, **variables}


def variables_rejected(instance: InstanceView, command: CommandView, problem: str) -> Decision:
    """The task's variables do not fit the workflow's state model (the runtime checks): nothing of
    them is stored and the position fails; an operator's retry opens the task again."""
    payload = command.payload if isinstance(command.payload, dict) else {}
    task = payload.get("task_id")
    rejected = RecordHistory("EXTERNAL_TASK_REJECTED", instance.step, instance.visit,
                             {"task_id": task, "worker": payload.get("worker"), "problem": problem})
    effects = fail(instance, "InvalidVariables", f"external task {task}: {problem}")
    return Decision(settled(effects), (rejected, *effects))


def with_state(instance: InstanceView, decision: Decision, state: JSON) -> Decision:
    """The same decision with the state the model normalised (defaults filled, values coerced)."""
    effects = tuple(e for e in decision.effects if not isinstance(e, SetState))
    return Decision(decision.settle, (*state_change(instance.state, state), *effects))
