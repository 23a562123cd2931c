"""Sagas: compensating the steps an instance completed, and its deadline.

A workflow whose plan declares a compensation on some step is a saga. When one of its steps
fails for good, when it is cancelled with compensation, or when its deadline passes, the steps
it completed that declare a compensation are undone in reverse order of completion (over every
position: branches in reverse order of their completion), one at a time, each under its own
retry policy, every attempt a history entry.

The saga runs on a position of its own, `SAGA`, so neither a running handler nor a branch holds
it up: a deadline timer fires there while the root position is busy (and the commit that begins
compensation takes the leases of every other position, so that handler's commit is refused),
and each compensation is a `COMPENSATE` command there, fenced and retried like any step. The
store keeps what each completed step recorded, picks the next compensation and queues it
(`AdvanceSaga`): the core only decides what one claimed command does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from stepstone.core.dead_letter import claims_spent, dead_lettered
from stepstone.core.effects import (
    AdvanceSaga,
    CloseTimers,
    EmitEvent,
    IfStopped,
    InterruptStep,
    MovePosition,
    RecordCompensable,
    RecordHistory,
    state_change,
)
from stepstone.core.entering import enter, fail, settled
from stepstone.core.failures import frames_document
from stepstone.core.model import (
    COMPENSATING,
    FAILED,
    JSON,
    CommandView,
    Decision,
    InstanceView,
    Settle,
    StepFailed,
    StepSucceeded,
)
from stepstone.core.plan import Plan

SAGA = "$saga"
"""The path of the position that carries an instance's deadline timer and its compensations."""

COMPENSATE = "COMPENSATE"
DEADLINE = "deadline"
"""The name of the deadline's TIMER command."""
STEP_DEADLINE = "step_deadline"
"""The TIMER of a step deadline: on `SAGA` when it passes, then on the step's position."""

COMPENSATION_FAILED_EVENT = "stepstone.compensation_failed"

log = logging.getLogger("stepstone.saga")

CAUSE_FAILED, CAUSE_CANCELLED, CAUSE_TIMED_OUT = "failed", "cancelled", "timed_out"


@dataclass(frozen=True)
class RunCompensation:
    """The claimed command runs one compensation handler; call `complete_compensation` after."""

    record: int
    step: str
    position: str
    visit: int
    recorded: JSON
    attempt: int
    cause: str | None


def on_step_failure(plan: Plan, decision: Decision) -> Decision:
    """A saga does not stop FAILED when a step fails for good: the same commit begins compensation.
    A dead letter (a command that kept crashing workers) still fails the instance for an operator."""
    if not plan.compensable or decision.settle.state == "DEAD":
        return decision
    failed = next((m for m in decision.of(MovePosition) if m.status == FAILED), None)
    if failed is None:
        return decision
    begun = RecordHistory("COMPENSATION_STARTED", failed.step, failed.visit,
                          {"cause": CAUSE_FAILED, "error": failed.error})
    # A saga undoes what it did at any step's failure, a branch's too: whether the branch's join could
    # still be met without it does not matter here, the instance stops (IfStopped's `stopped` side).
    # It never is FAILED, so no INSTANCE_FAILED entry: COMPENSATION_STARTED carries the error, and the
    # saga's end (INSTANCE_COMPENSATED, or COMPENSATION_FAILED) is its status change.
    effects = tuple(x for e in decision.effects for x in (e.stopped if isinstance(e, IfStopped) else (e,))
                    if not (isinstance(x, RecordHistory) and x.kind == "INSTANCE_FAILED"))
    return Decision(decision.settle, (*effects, begun, AdvanceSaga("begin", cause=CAUSE_FAILED)))


def on_step_success(plan: Plan, step: str, visit: int, outcome: StepSucceeded, decision: Decision) -> Decision:
    """A completed step that declares a compensation is remembered with what it recorded."""
    if plan.steps[step].compensation is None:  # most steps: no need to look through the effects
        return decision
    if not any(h.kind == "STEP_COMPLETED" and h.step == step for h in decision.of(RecordHistory)):
        return decision
    return Decision(decision.settle, (*decision.effects, RecordCompensable(step, visit, outcome.recorded)))


def apply_saga(
    instance: InstanceView, command: CommandView, plan: Plan, max_claims: int
) -> RunCompensation | Decision:
    """What a command of the `SAGA` position does: a deadline fires, a compensation runs, or a child
    this saga asked to compensate itself reports back."""
    if command.kind == "TIMER" and command.name == DEADLINE:
        return _deadline(instance)
    if command.kind == "TIMER" and command.name == STEP_DEADLINE:
        return _interrupt(instance, command, plan)
    payload = command.payload if isinstance(command.payload, dict) else {}
    if command.kind not in (COMPENSATE, "CHILD_COMPLETION"):
        return Decision(Settle("REJECTED", f"NOT_A_SAGA_COMMAND: {command.kind}"))
    if instance.status != COMPENSATING:
        return Decision(Settle("REJECTED", f"NOT_COMPENSATING: {instance.status}"))
    if command.kind == "CHILD_COMPLETION":
        return _child_compensated(instance, plan, payload)
    return _compensate(instance, command, plan, max_claims, payload)


def _deadline(instance: InstanceView) -> Decision:
    if instance.status in (COMPENSATING, "COMPENSATION_FAILED"):
        return Decision(Settle("STALE", "ALREADY_COMPENSATING"))
    if instance.status == FAILED:  # it waits for an operator, who may still retry it (or cancel it)
        kept = {"cause": CAUSE_TIMED_OUT, "status_before": FAILED, "outcome": "left FAILED for an operator"}
        return Decision(Settle("COMPLETE"), (RecordHistory("DEADLINE_PASSED", None, None, kept),))
    data = {"cause": CAUSE_TIMED_OUT, "status_before": instance.status}
    return Decision(Settle("COMPLETE"), (
        RecordHistory("DEADLINE_PASSED", None, None, data),
        AdvanceSaga("begin", cause=CAUSE_TIMED_OUT),
    ))


def _interrupt(instance: InstanceView, command: CommandView, plan: Plan) -> Decision:
    """A step deadline passed: interrupt the position if it still runs that step visit. The store checks,
    and records STEP_DEADLINE_PASSED only then: a step left in time ignores its deadline, in history too.
    A timer scheduled under an earlier plan whose step the instance's plan now has without a deadline, or
    not at all (an instance migrated by a release that did not refuse it), is moot: settled so, with a
    STEP_DEADLINE_MOOT entry, and the step goes on under its plan."""
    if instance.status in (COMPENSATING, "COMPENSATION_FAILED"):
        return Decision(Settle("STALE", "ALREADY_COMPENSATING"))
    payload = command.payload if isinstance(command.payload, dict) else {}
    step, visit, position = str(payload.get("step")), int(payload.get("visit") or 0), str(payload.get("position"))
    declared = plan.steps.get(step)
    if declared is None or declared.deadline_seconds is None:
        return _moot(step, visit, position, plan)
    return Decision(Settle("COMPLETE"), (InterruptStep(position, step, visit),))


def _moot(step: str, visit: int, position: str, plan: Plan) -> Decision:
    """A step deadline timer the instance's plan does not back: settled STALE, said in history and the log."""
    why = "has no step deadline" if step in plan.steps else "has no such step"
    log.warning("step deadline of %r (visit %d) is moot: v%d of %s %s", step, visit, plan.version,
                plan.definition_id, why)
    data = {"position": position, "version": plan.version, "reason": f"v{plan.version} {why}"}
    return Decision(Settle("STALE", "STEP_DEADLINE_MOOT"), (RecordHistory("STEP_DEADLINE_MOOT", step, visit, data),))


def step_deadline_passed(instance: InstanceView, command: CommandView, plan: Plan, now: datetime) -> Decision:
    """On the step's own position: the step ran out of time; `on_deadline`, or the step fails."""
    there = (instance.position_status or instance.status) in ("RUNNING", "WAITING")
    if not there or command.visit != instance.visit or command.step != instance.step:
        return Decision(Settle("STALE", "STEP_DEADLINE_SUPERSEDED"))
    step = plan.steps.get(instance.step or "")
    # Interrupted under an earlier plan (see _interrupt), on one whose step has no deadline: a wait or a
    # timer goes on waiting (the interrupt settled no command of theirs); an action, whose step command the
    # interrupt settled, fails (StepDeadline): nothing is left to run it on.
    if step is None or (step.deadline_seconds is None and step.kind in ("wait", "timer")):
        return _moot(command.step or "", command.visit or 0, instance.position, plan)
    # Leaving a wait or a timer early: its own timers (a wait's timeout, the timer) are superseded.
    leave = (CloseTimers(),) if step.kind in ("wait", "timer") else ()
    exceeded = RecordHistory("STEP_DEADLINE_EXCEEDED", step.name, instance.visit,
                             {"deadline_seconds": step.deadline_seconds, "on_deadline": step.on_deadline})
    if step.on_deadline:
        entered = enter(instance, plan, step.on_deadline, instance.state, now)
    else:
        within = "its deadline" if step.deadline_seconds is None else f"{step.deadline_seconds:g} s"
        entered = fail(instance, "StepDeadline", f"step {step.name!r} did not finish within {within}",
                       step=step.name)
    return Decision(settled(entered), (exceeded, *leave, *entered))


def _compensate(
    instance: InstanceView, command: CommandView, plan: Plan, max_claims: int, payload: dict[str, JSON]
) -> RunCompensation | Decision:
    recorded = payload.get("recorded")
    if isinstance(recorded, dict) and recorded.get("kind") == "child":
        data = {"record": payload["record"], "child_id": recorded.get("child_id")}
        visit = payload.get("visit")
        return Decision(Settle("COMPLETE"), (
            RecordHistory("CHILD_COMPENSATING", str(payload["step"]), int(visit) if visit else None, data),
            AdvanceSaga("compensate_child", record=int(payload["record"]), child=str(recorded.get("child_id"))),
        ))
    run = RunCompensation(
        record=int(payload["record"]), step=str(payload["step"]), position=str(payload.get("position") or ""),
        visit=int(payload.get("visit") or 0), recorded=recorded, attempt=command.attempt,
        cause=payload.get("cause"),
    )
    if dead_lettered(command, max_claims):  # it kept crashing workers: give up as an exhausted compensation
        reason = claims_spent(command, max_claims)
        declared = plan.steps[run.step].compensation if run.step in plan.steps else None
        name = declared.name if declared is not None else ""
        return _exhausted(instance, run, {"type": "DeadLetter", "message": reason}, name, plan.definition_id)
    return run


def on_child_completed(plan: Plan, step: str, visit: int, child_id: object) -> tuple[RecordCompensable, ...]:
    """In a saga, a child that completed is compensated, when the saga compensates, by compensating it; a
    detached one (`cancel_with_parent` False) is not: neither a cancel nor a compensation touches it."""
    if not plan.compensable or not plan.steps[step].cancel_with_parent:
        return ()
    return (RecordCompensable(step, visit, {"kind": "child", "child_id": child_id}),)


def _child_compensated(instance: InstanceView, plan: Plan, payload: dict[str, JSON]) -> Decision:
    """A child this saga asked to compensate itself ended: COMPENSATED (or ended another way) lets the
    saga go on; COMPENSATION_FAILED stops it too, to be retried once the child can be."""
    record, step, visit = int(payload.get("record") or 0), str(payload.get("step") or ""), payload.get("visit")
    data = {"record": record, "child_id": payload.get("child_id"), "status": payload.get("status")}
    if payload.get("status") != "COMPENSATION_FAILED":
        return Decision(Settle("COMPLETE"), (
            RecordHistory("STEP_COMPENSATED", step, visit, {**data, "attempt": 1}),
            AdvanceSaga("done", record=record, attempts=1),
        ))
    error = payload.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    run = RunCompensation(record, step, "", int(visit or 0), None, 1, None)
    return _exhausted(instance, run, {"type": "ChildCompensationFailed",
                                      "message": f"child {payload.get('child_id')} could not compensate: {message}"},
                      "", plan.definition_id)


def complete_compensation(
    instance: InstanceView, plan: Plan, run: RunCompensation, outcome: StepSucceeded | StepFailed
) -> Decision:
    """Turn a compensation handler's outcome into its commit."""
    step = plan.steps.get(run.step)
    where = {"record": run.record, "position": run.position, "attempt": run.attempt}
    if isinstance(outcome, StepSucceeded):
        state = state_change(instance.state, outcome.state)
        events = tuple(e.to_effect(n) for n, e in enumerate(outcome.events))
        return Decision(Settle("COMPLETE"), (
            RecordHistory("STEP_COMPENSATED", run.step, run.visit, where),
            *state, *events,
            AdvanceSaga("done", record=run.record, attempts=run.attempt),
        ))
    compensation = step.compensation if step is not None else None
    name = compensation.name if compensation is not None else ""
    if compensation is None:
        outcome = StepFailed("UnknownCompensation", f"the pinned plan declares no compensation on {run.step!r}",
                             retryable=False)
    error = {"type": outcome.error_type, "message": outcome.message,
             **frames_document(outcome.frames, outcome.frames_omitted, outcome.cause)}
    policy = compensation.retry if compensation is not None else None
    retryable = outcome.retryable and policy is not None and outcome.error_type not in policy.non_retryable
    if policy is not None and retryable and run.attempt < policy.max_attempts:
        delay = policy.backoff(run.attempt)
        return Decision(
            Settle("RETRY", f"{outcome.error_type}: {outcome.message}", retry_delay=delay),
            (RecordHistory("COMPENSATION_ATTEMPT_FAILED", run.step, run.visit,
                           {**where, "compensation": name, "error": error, "retry_in": delay}),
             AdvanceSaga("attempt_failed", record=run.record, attempts=run.attempt, error=error)),
        )
    return _exhausted(instance, run, error, name, plan.definition_id)


def _exhausted(
    instance: InstanceView, run: RunCompensation, error: dict[str, JSON], name: str, workflow: str,
) -> Decision:
    """The compensation is given up: COMPENSATION_FAILED, one history entry, one outbox event (in
    this commit, so exactly once however many workers raced for it) and the worker's alert hook.
    `error` is the last attempt's (`type`, `message`, and `frames` where its handler raised)."""
    error_type, message = error["type"], error["message"]
    alert = alert_payload(instance.id, workflow, run, name, error)
    return Decision(Settle("FAILED", f"{error_type}: {message}"), (
        RecordHistory("COMPENSATION_FAILED", run.step, run.visit, alert),
        AdvanceSaga("exhausted", record=run.record, attempts=run.attempt, error=error),
        EmitEvent(COMPENSATION_FAILED_EVENT, alert, key=instance.id),
    ))


def alert_payload(instance_id: str, workflow: str, run: RunCompensation, name: str, error: JSON) -> dict[str, JSON]:
    """What the alert says: instance, workflow, step, compensation, attempts and last error."""
    return {"instance_id": instance_id, "workflow": workflow, "step": run.step, "position": run.position,
            "compensation": name, "attempts": run.attempt, "last_error": error}


def exhausted_alert(decision: Decision) -> dict[str, JSON] | None:
    """The alert a committed decision raised, if it gave a compensation up."""
    event = decision.first(EmitEvent)
    if event is None or event.type != COMPENSATION_FAILED_EVENT:
        return None
    return dict(event.payload)

