"""The transition function: what a claimed command does to one position of an instance.

`apply(instance, command, plan, now)` answers either `RunStep` (run the current
action or child step's handler, then call `complete_step`) or a `Decision` the
store commits as is. Neither raises for a domain outcome: a late signal, a stale
timer, a failing handler, a callback for a cancelled branch and a poison command
are all decisions. Arriving at a step is `core.entering.enter`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from itertools import islice, takewhile
from typing import Any

from stepstone.core.baselines import step_completed
from stepstone.core.dead_letter import claims_spent, dead_lettered
from stepstone.core.effects import (
    CloseTimers,
    IfStopped,
    MovePosition,
    NotifyParent,
    RecordHistory,
    SetState,
    SettleQueued,
    StartChild,
    WithinStepDeadline,
    state_change,
)
from stepstone.core.entering import child_failed, enter, fail, failed, join_branch, settled
from stepstone.core.external_completion import awaited, external_done
from stepstone.core.failures import frames_document
from stepstone.core.leaving_waits import LATE, within_deadline
from stepstone.core.messages import message_received, signal_cause
from stepstone.core.model import (
    CANCELLED,
    COMPLETED,
    FAILED,
    POSITION_CLOSED,
    RUNS_STEP,
    TERMINAL,
    WAITING,
    CommandView,
    Decision,
    InstanceView,
    RunStep,
    Settle,
    StepFailed,
    StepSucceeded,
)
from stepstone.core.patch import diff
from stepstone.core.plan import END, Plan
from stepstone.core.saga import (
    SAGA,
    STEP_DEADLINE,
    RunCompensation,
    apply_saga,
    on_child_completed,
    on_step_failure,
    on_step_success,
    step_deadline_passed,
)
from stepstone.core.task_transitions import task_completed, task_timer

_CHILDREN = uuid.UUID("0b5c7d2e-8f4a-4c61-9d3e-6a1f2b7c8e90")


def child_id(instance_id: str, position: str, step: str, visit: int) -> str:
    """The child a step visit starts: the same id on every attempt, so it is started once."""
    return str(uuid.uuid5(_CHILDREN, f"{instance_id}/{position}/{step}/{visit}"))


def apply(
    instance: InstanceView, command: CommandView, plan: Plan, now: datetime, max_claims: int = 5
) -> RunStep | RunCompensation | Decision:
    """Decide what the claimed `command` does to `instance` (seen from its position) under `plan`."""
    if instance.status in TERMINAL:
        reason = "INSTANCE_CANCELLED" if instance.status == CANCELLED else "INSTANCE_ENDED"
        return Decision(Settle("STALE" if command.kind == "TIMER" else "REJECTED", reason))
    if instance.position == SAGA:
        return apply_saga(instance, command, plan, max_claims)
    if instance.position_status in POSITION_CLOSED:
        return _ignored(instance, command, f"POSITION_{instance.position_status}")
    if dead_lettered(command, max_claims):
        return _finish(instance, _dead_letter(instance, command, max_claims))
    handle = _run_current_step if command.kind in RUNS_STEP else _BY_KIND.get(command.kind)
    if handle is None:
        return Decision(Settle("REJECTED", f"UNKNOWN_KIND: {command.kind}"))
    outcome = handle(instance, command, plan, now)
    return outcome if isinstance(outcome, RunStep) else _finish(instance, on_step_failure(plan, outcome))


def _external_completion(instance: InstanceView, command: CommandView, plan: Plan, now: datetime) -> Decision:
    if not awaited(instance, command):
        return _ignored(instance, command, "EXTERNAL_TASK_NOT_AWAITED")
    return external_done(instance, command, plan, now)


def complete_step(
    instance: InstanceView,
    command: CommandView,
    plan: Plan,
    outcome: StepSucceeded | StepFailed,
    now: datetime,
) -> Decision:
    """Turn a handler's outcome into the commit of its step."""
    decision = _complete(instance, command, plan, outcome, now)
    if isinstance(outcome, StepSucceeded):
        decision = on_step_success(plan, instance.step or "", instance.visit, outcome, decision)
    decision = _finish(instance, on_step_failure(plan, decision))
    step = plan.steps[instance.step or ""]
    if step.deadline_seconds is None:
        return decision
    return Decision(decision.settle, (*decision.effects, WithinStepDeadline(step.name, instance.visit)))


def _complete(
    instance: InstanceView, command: CommandView, plan: Plan, outcome: StepSucceeded | StepFailed, now: datetime
) -> Decision:
    step = plan.steps[instance.step or ""]
    visit = instance.visit
    if isinstance(outcome, StepSucceeded) and step.kind == "child":
        return _start_child(instance, command, plan, outcome)
    if isinstance(outcome, StepSucceeded):
        target = outcome.next
        if target is None and len(step.next) == 1:
            target = step.next[0]
        if target is None and not step.next:
            target = END
        if target not in step.next and not (target == END and not step.next):
            allowed = ", ".join(step.next) or "the end"
            outcome = StepFailed(
                "InvalidTransition", f"step {step.name!r} returned {target!r}; it may go to {allowed}", retryable=False
            )
        else:
            ops = diff(instance.state, outcome.state)
            done = step_completed(step.name, visit, command.attempt, ops, outcome.state)
            events = [e.to_effect(n) for n, e in enumerate(outcome.events)]
            entered = enter(instance, plan, target or END, outcome.state, now)
            return Decision(settled(entered),
                            (*done, *state_change(instance.state, outcome.state, ops), *entered, *events))
    failure = {"step": step.name, "type": outcome.error_type, "message": outcome.message, "attempt": command.attempt,
               **frames_document(outcome.frames, outcome.frames_omitted, outcome.cause)}
    retryable = outcome.retryable and outcome.error_type not in step.retry.non_retryable
    if retryable and command.attempt < step.retry.max_attempts:
        delay = step.retry.backoff(command.attempt)
        return Decision(
            Settle("RETRY", f"{outcome.error_type}: {outcome.message}", retry_delay=delay),
            (RecordHistory("STEP_FAILED", step.name, visit,
                           {**failure, "retry_in": delay, "max_attempts": step.retry.max_attempts}),),
        )
    return Decision(
        Settle("FAILED", f"{outcome.error_type}: {outcome.message}"),
        (RecordHistory("STEP_FAILED", step.name, visit, failure), *failed(instance, step.name, visit, failure)),
    )


def _start_child(instance: InstanceView, command: CommandView, plan: Plan, outcome: StepSucceeded) -> Decision:
    step = plan.steps[instance.step or ""]
    spec = outcome.child
    if spec is None:
        return _failed(instance, "InvalidChild", f"child step {step.name!r} produced no child input")
    cid = child_id(instance.id, instance.position, step.name, instance.visit)
    wait = {"kind": "child", "child_id": cid, "workflow": spec.definition_id}
    started = {"child_id": cid, "workflow": spec.definition_id, "version": spec.version, "attempt": command.attempt}
    events = [e.to_effect(n) for n, e in enumerate(outcome.events)]
    ops = diff(instance.state, outcome.state)
    return Decision(
        Settle("COMPLETE"),
        (
            *step_completed(step.name, instance.visit, command.attempt, ops, outcome.state),
            *state_change(instance.state, outcome.state, ops),
            StartChild(cid, spec.definition_id, spec.version, spec.plan_hash, spec.state, spec.step,
                       cancel_with_parent=step.cancel_with_parent, deadline_seconds=spec.deadline_seconds,
                       start_deadline_seconds=spec.start_deadline_seconds),
            MovePosition(WAITING, step.name, instance.visit, wait=wait),
            RecordHistory("CHILD_STARTED", step.name, instance.visit, started),
            *events,
        ),
    )


def _run_current_step(instance: InstanceView, command: CommandView, plan: Plan, now: datetime) -> RunStep | Decision:
    if command.visit is not None and command.visit != instance.visit:
        return Decision(Settle("STALE", "STEP_SUPERSEDED"))
    step = plan.steps.get(instance.step or "")
    if step is None:
        return _failed(instance, "UnknownStep", f"the pinned plan has no step {instance.step!r}")
    if step.kind in ("action", "child"):
        return RunStep(step.name, instance.visit, command.attempt)
    # A start or retry that lands on a timer, wait or fork enters it without a handler.
    entered = enter(instance, plan, step.name, instance.state, now, same_visit=True)
    return Decision(settled(entered), tuple(entered))


def _signal(instance: InstanceView, command: CommandView, plan: Plan, now: datetime) -> Decision:
    wait = instance.wait or {}
    accepted: dict[str, str] = wait.get("signals", {}) if _waiting(instance) else {}
    name = command.name or ""
    if name not in accepted:
        return Decision(
            Settle("PARKED", "NOT_WAITING"),
            (RecordHistory("SIGNAL_PARKED", instance.step, instance.visit, {"signal": name}),),
        )
    received = RecordHistory("SIGNAL_APPLIED", instance.step, instance.visit, {"signal": name, "command": command.id})
    cause = signal_cause("SIGNAL", name, command.payload)
    entered = enter(instance, plan, accepted[name], instance.state, now, cause=cause)
    parked = RecordHistory("SIGNAL_PARKED", instance.step, instance.visit, {"signal": name, "reason": LATE})
    return within_deadline(instance, plan, Decision(settled(entered), (received, CloseTimers(), *entered)),
                           Settle("PARKED", LATE), parked)


def _timer(instance: InstanceView, command: CommandView, plan: Plan, now: datetime) -> Decision:
    if command.name == STEP_DEADLINE:
        return step_deadline_passed(instance, command, plan, now)
    if (instance.wait or {}).get("kind") == "task":
        return task_timer(instance, command, plan, now)
    if not _waiting(instance) or command.visit != instance.visit:
        return Decision(Settle("STALE", "TIMER_SUPERSEDED"))
    step = plan.steps.get(instance.step or "")
    if step is None:
        return _failed(instance, "UnknownStep", f"the pinned plan has no step {instance.step!r}")
    if command.name == "timeout" and step.on_timeout:
        kind, target = "WAIT_TIMED_OUT", step.on_timeout
    else:
        kind, target = "TIMER_FIRED", step.next[0]
    entered = enter(instance, plan, target, instance.state, now)
    decision = Decision(settled(entered), (RecordHistory(kind, step.name, instance.visit), CloseTimers(), *entered))
    return within_deadline(instance, plan, decision, Settle("STALE", LATE))


def _branch_done(instance: InstanceView, command: CommandView, plan: Plan, now: datetime) -> Decision:
    wait = instance.wait or {}
    if not _reports_to_join(instance, wait, command):
        if (instance.position_status or instance.status) == FAILED and _of_this_join(instance, wait, command):
            # The join failed at a report (dead-lettered: it keeps its count): counted here, this report
            # would set the failed position waiting again with the dead one never counted. It waits for the
            # retry, which offers it again with the dead one (migration 0086).
            data = {"command": command.id, "branch": command.payload["branch"], "reason": "POSITION_FAILED"}
            return Decision(Settle("PARKED", "POSITION_FAILED"),
                            (RecordHistory("BRANCH_PARKED", instance.step, instance.visit, data),))
        return _ignored(instance, command, "JOIN_NOT_WAITING")
    # The reports queued right behind this one join in the same commit: a map's branches finish faster
    # than its fork's position takes one report a segment, and each segment read the whole state
    # (docs/branches.md, "Large maps"). Only as many as the join still needs, in queue order, and none
    # past the first command that is not such a report, so nothing overtakes what queued before it.
    more = list(islice(takewhile(lambda c: _reports_to_join(instance, wait, c), command.behind),
                       reports_wanted(instance, command)))
    effects = join_branch(instance, plan, wait, [str(c.payload.get("branch")) for c in (command, *more)], now)
    if more:
        effects.append(SettleQueued(tuple(c.id for c in more)))
    return Decision(settled(effects), tuple(effects))


def reports_wanted(instance: InstanceView, command: CommandView) -> int:
    """How many branch reports queued behind `command` its join could take in the same commit: none
    unless it is a report the join waits for and the join still needs more than this one."""
    wait = instance.wait or {}
    if not _reports_to_join(instance, wait, command):
        return 0
    return max(int(wait["need"]) - int(wait["done"]) - 1, 0)


def _reports_to_join(instance: InstanceView, wait: dict[str, Any], command: CommandView) -> bool:
    """A branch's report that the join this position waits at counts: its fork, this visit, the position
    waiting (a failed one keeps its join's wait)."""
    return _of_this_join(instance, wait, command) and _waiting(instance)


def _of_this_join(instance: InstanceView, wait: dict[str, Any], command: CommandView) -> bool:
    """A branch's report of the fork whose join this position holds: its fork, this visit."""
    payload = command.payload if isinstance(command.payload, dict) else {}
    return (command.kind == "BRANCH_DONE" and wait.get("kind") == "join" and command.visit == instance.visit
            and payload.get("fork") == wait.get("fork"))


def _child_done(instance: InstanceView, command: CommandView, plan: Plan, now: datetime) -> Decision:
    wait = instance.wait or {}
    payload = command.payload if isinstance(command.payload, dict) else {}
    awaited = wait.get("kind") == "child" and payload.get("child_id") == wait.get("child_id")
    if not awaited or command.visit != instance.visit:
        return _ignored(instance, command, "CHILD_NOT_AWAITED")
    step = plan.steps[instance.step or ""]
    outcome = {"child_id": payload.get("child_id"), "status": payload.get("status")}
    cause = {"child": {**outcome, "state": payload.get("state"), "error": payload.get("error")}}
    if payload.get("status") == COMPLETED:
        entered = enter(instance, plan, step.next[0], instance.state, now, cause=cause)
        done = RecordHistory("CHILD_COMPLETED", step.name, instance.visit, outcome)
        undo = on_child_completed(plan, step.name, instance.visit, payload.get("child_id"))
        return Decision(settled(entered), (done, *undo, *entered))
    done = RecordHistory("CHILD_FAILED", step.name, instance.visit, {**outcome, "error": payload.get("error")})
    if step.on_failure:
        entered = enter(instance, plan, step.on_failure, instance.state, now, cause=cause)
        return Decision(settled(entered), (done, *entered))
    effects = child_failed(instance, step.name, payload)
    return Decision(settled(effects), (done, *effects))


def _failed(instance: InstanceView, error_type: str, message: str) -> Decision:
    effects = fail(instance, error_type, message)
    return Decision(settled(effects), tuple(effects))


def _waiting(instance: InstanceView) -> bool:
    return (instance.position_status or instance.status) == WAITING


def _ignored(instance: InstanceView, command: CommandView, reason: str) -> Decision:
    """A late callback (a cancelled branch's signal, a superseded child's end): recorded, never applied."""
    if command.kind == "TIMER":
        return Decision(Settle("STALE", reason))
    data = {"command": command.id, "kind": command.kind, "name": command.name, "reason": reason}
    return Decision(Settle("REJECTED", reason),
                    (RecordHistory("CALLBACK_IGNORED", instance.step, instance.visit, data),))


def _dead_letter(instance: InstanceView, command: CommandView, max_claims: int) -> Decision:
    reason = f"ATTEMPTS_EXHAUSTED: {claims_spent(command, max_claims)}"
    dead = RecordHistory(
        "COMMAND_DEAD_LETTERED", instance.step, instance.visit, {"command": command.id, "kind": command.kind}
    )
    if command.kind == "SIGNAL":
        return Decision(Settle("DEAD", reason), (dead,))
    error = {"step": instance.step, "type": "DeadLetter", "message": reason}
    return Decision(Settle("DEAD", reason),
                    (dead, *failed(instance, instance.step, instance.visit, error, instance.wait)))


def _finish(instance: InstanceView, decision: Decision) -> Decision:
    """A child that ends or fails tells its parent, in the same commit."""
    parent = instance.parent
    if parent is None:
        return decision
    if decision.ended:
        new_state = decision.first(SetState)
        state = instance.state if new_state is None else new_state.state
        payload = {"child_id": instance.id, "status": COMPLETED, "state": state}
    else:
        moved = next((m for m in decision.of(MovePosition) if m.status == FAILED), None)
        if moved is None:
            return decision
        payload = {"child_id": instance.id, "status": FAILED, "error": moved.error}
    notify = NotifyParent(parent.id, parent.position, parent.visit, payload)
    branch = decision.first(IfStopped)
    if branch is not None:  # a branch's failure: the parent hears of it only if it stops this instance
        return Decision(decision.settle, tuple(
            replace(e, stopped=(*e.stopped, notify)) if e is branch else e for e in decision.effects))
    return Decision(decision.settle, (*decision.effects, notify))


def advance(instance: InstanceView, decision: Decision, state_version: int) -> InstanceView:
    """The instance as a committed decision left it, seen from the same position, without reading it back."""
    move = decision.first(MovePosition)
    new_state = decision.first(SetState)
    state = instance.state if new_state is None else new_state.state
    if move is None:
        return InstanceView(instance.id, instance.status, instance.step, instance.visit, state, instance.wait,
                            instance.position, instance.position_status, state_version, instance.parent,
                            instance.branch)
    return InstanceView(instance.id, move.status, move.step, move.visit, state, move.wait, instance.position,
                        move.status, state_version, instance.parent, instance.branch)


_BY_KIND: dict[str, Callable[[InstanceView, CommandView, Plan, datetime], RunStep | Decision]] = {
    "SIGNAL": _signal,
    "TIMER": _timer,
    "BRANCH_DONE": _branch_done,
    "CHILD_COMPLETION": _child_done,
    "EXTERNAL_COMPLETION": _external_completion,
    "TASK_COMPLETION": task_completed,
    "MESSAGE": message_received,
}
"""What each kind of command (other than those that run the current step) does at its position."""
