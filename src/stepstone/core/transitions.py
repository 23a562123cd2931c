"""The transition function: what a claimed command does to an instance.

`apply(instance, command, plan, now)` answers either `RunStep` (run the current
action step's handler, then call `complete_step`) or a `Decision` the store
commits as is. Neither raises for a domain outcome: a late signal, a stale
timer, a failing handler and a poison command are all decisions.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from stepstone.core.model import (
    CANCELLED,
    COMPLETED,
    FAILED,
    JSON,
    RUNNING,
    RUNS_STEP,
    TERMINAL,
    WAITING,
    CommandView,
    Decision,
    HistoryEntry,
    InstanceChange,
    InstanceView,
    NewCommand,
    RunStep,
    Settle,
    StepFailed,
    StepSucceeded,
)
from stepstone.core.patch import diff, same
from stepstone.core.plan import END, Plan


def apply(
    instance: InstanceView, command: CommandView, plan: Plan, now: datetime, max_claims: int = 5
) -> RunStep | Decision:
    """Decide what the claimed `command` does to `instance` under its pinned `plan`."""
    if instance.status in TERMINAL:
        reason = "INSTANCE_CANCELLED" if instance.status == CANCELLED else "INSTANCE_ENDED"
        return Decision(Settle("STALE" if command.kind == "TIMER" else "REJECTED", reason))
    if command.claims > max_claims:
        return _dead_letter(instance, command, max_claims)
    if command.kind in RUNS_STEP:
        return _run_current_step(instance, command, plan, now)
    if command.kind == "SIGNAL":
        return _signal(instance, command, plan, now)
    if command.kind == "TIMER":
        return _timer(instance, command, plan, now)
    return Decision(Settle("REJECTED", f"UNKNOWN_KIND: {command.kind}"))


def complete_step(
    instance: InstanceView,
    command: CommandView,
    plan: Plan,
    outcome: StepSucceeded | StepFailed,
    now: datetime,
) -> Decision:
    """Turn a handler's outcome into the commit of its step."""
    step = plan.steps[instance.step or ""]
    visit = instance.visit
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
            patch = diff(instance.state, outcome.state)
            done = HistoryEntry("STEP_COMPLETED", step.name, visit, {"attempt": command.attempt, "patch": patch})
            entered = _enter(instance, plan, target or END, outcome.state, now)
            return Decision(
                Settle("COMPLETE"),
                instance=entered.instance,
                history=(done, *entered.history),
                commands=entered.commands,
                events=outcome.events,
                requeue_signals=entered.requeue_signals,
                ended=entered.ended,
            )
    failure = {"step": step.name, "type": outcome.error_type, "message": outcome.message, "attempt": command.attempt}
    retryable = outcome.retryable and outcome.error_type not in step.retry.non_retryable
    if retryable and command.attempt < step.retry.max_attempts:
        delay = step.retry.backoff(command.attempt)
        return Decision(
            Settle("RETRY", f"{outcome.error_type}: {outcome.message}", retry_delay=delay),
            history=(HistoryEntry("STEP_FAILED", step.name, visit, {**failure, "retry_in": delay}),),
        )
    return Decision(
        Settle("FAILED", f"{outcome.error_type}: {outcome.message}"),
        instance=InstanceChange(FAILED, step.name, visit, wait=None, error=failure),
        history=(
            HistoryEntry("STEP_FAILED", step.name, visit, failure),
            HistoryEntry("INSTANCE_FAILED", step.name, visit, failure),
        ),
    )


def _run_current_step(instance: InstanceView, command: CommandView, plan: Plan, now: datetime) -> RunStep | Decision:
    if command.visit is not None and command.visit != instance.visit:
        return Decision(Settle("STALE", "STEP_SUPERSEDED"))
    step = plan.steps.get(instance.step or "")
    if step is None:
        return _fail(instance, "UnknownStep", f"the pinned plan has no step {instance.step!r}")
    if step.kind == "action":
        return RunStep(step.name, instance.visit, command.attempt)
    # A start or retry that lands on a timer or wait enters it without a handler.
    entered = _enter(instance, plan, step.name, instance.state, now, same_visit=True)
    return Decision(
        Settle("COMPLETE"),
        instance=entered.instance,
        history=entered.history,
        commands=entered.commands,
        requeue_signals=entered.requeue_signals,
        ended=entered.ended,
    )


def _signal(instance: InstanceView, command: CommandView, plan: Plan, now: datetime) -> Decision:
    wait = instance.wait or {}
    accepted: dict[str, str] = wait.get("signals", {}) if instance.status == WAITING else {}
    name = command.name or ""
    if name not in accepted:
        return Decision(
            Settle("PARKED", "NOT_WAITING"),
            history=(HistoryEntry("SIGNAL_PARKED", instance.step, instance.visit, {"signal": name}),),
        )
    received = HistoryEntry("SIGNAL_APPLIED", instance.step, instance.visit, {"signal": name, "command": command.id})
    cause = {"signal": {"name": name, "payload": command.payload}}
    entered = _enter(instance, plan, accepted[name], instance.state, now, cause=cause)
    return Decision(
        Settle("COMPLETE"),
        instance=entered.instance,
        history=(received, *entered.history),
        commands=entered.commands,
        close_timers=True,
        requeue_signals=entered.requeue_signals,
        ended=entered.ended,
    )


def _timer(instance: InstanceView, command: CommandView, plan: Plan, now: datetime) -> Decision:
    if instance.status != WAITING or command.visit != instance.visit:
        return Decision(Settle("STALE", "TIMER_SUPERSEDED"))
    step = plan.steps.get(instance.step or "")
    if step is None:
        return _fail(instance, "UnknownStep", f"the pinned plan has no step {instance.step!r}")
    if command.name == "timeout" and step.on_timeout:
        kind, target = "WAIT_TIMED_OUT", step.on_timeout
    else:
        kind, target = "TIMER_FIRED", step.next[0]
    entered = _enter(instance, plan, target, instance.state, now)
    return Decision(
        Settle("COMPLETE"),
        instance=entered.instance,
        history=(HistoryEntry(kind, step.name, instance.visit), *entered.history),
        commands=entered.commands,
        close_timers=True,
        requeue_signals=entered.requeue_signals,
        ended=entered.ended,
    )


def _enter(
    instance: InstanceView,
    plan: Plan,
    target: str,
    state: JSON,
    now: datetime,
    *,
    cause: JSON = None,
    same_visit: bool = False,
) -> Decision:
    """Arrive at `target` with `state`: the instance change and what waiting there needs.

    `cause` (the signal that led here) travels with the continuation, so the next
    handler sees it as `ctx.signal`.
    """
    visit = instance.visit if same_visit else instance.visit + 1
    new_state = None if same(state, instance.state) else state
    if target == END:
        return Decision(
            Settle("COMPLETE"),
            instance=InstanceChange(COMPLETED, None, visit, state=new_state),
            history=(HistoryEntry("INSTANCE_COMPLETED", None, visit),),
            ended=True,
        )
    step = plan.steps[target]
    if step.kind == "action":
        return Decision(
            Settle("COMPLETE"),
            instance=InstanceChange(RUNNING, target, visit, state=new_state),
            commands=(NewCommand("STEP", target, visit, payload=cause, continuation=True),),
        )
    if step.kind == "timer":
        at = None
        if step.until is not None:
            at = _instant(state, step.until, now)
            if at is None:
                problem = f"timer step {target!r}: state field {step.until!r} is not an ISO 8601 instant with a zone"
                at_timer = InstanceView(instance.id, instance.status, target, visit, state)
                return _fail(at_timer, "InvalidTimer", problem, new_state)
        timer: dict[str, Any] = {"kind": "timer", "delay_seconds": step.delay_seconds, "until": at}
        return Decision(
            Settle("COMPLETE"),
            instance=InstanceChange(WAITING, target, visit, wait=timer, state=new_state),
            history=(HistoryEntry("WAITING", target, visit, timer),),
            commands=(NewCommand("TIMER", target, visit, name="fire", delay=step.delay_seconds, at=at),),
        )
    wait = {"kind": "signal", "signals": dict(step.signals), "timeout_seconds": step.timeout_seconds}
    timeout = () if step.timeout_seconds is None else (
        NewCommand("TIMER", target, visit, name="timeout", delay=step.timeout_seconds),
    )
    return Decision(
        Settle("COMPLETE"),
        instance=InstanceChange(WAITING, target, visit, wait=wait, state=new_state),
        history=(HistoryEntry("WAITING", target, visit, wait),),
        commands=timeout,
        requeue_signals=tuple(sorted(step.signals)),
    )


def _instant(state: JSON, field: str, now: datetime) -> str | None:
    """The instant in `state[field]`; one already past counts as now."""
    value = state.get(field) if isinstance(state, dict) else None
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        return None
    return max(parsed, now).isoformat()


def _fail(instance: InstanceView, error_type: str, message: str, state: JSON = None) -> Decision:
    error = {"step": instance.step, "type": error_type, "message": message}
    return Decision(
        Settle("FAILED", f"{error_type}: {message}"),
        instance=InstanceChange(FAILED, instance.step, instance.visit, state=state, error=error),
        history=(HistoryEntry("INSTANCE_FAILED", instance.step, instance.visit, error),),
    )


def _dead_letter(instance: InstanceView, command: CommandView, max_claims: int) -> Decision:
    reason = f"ATTEMPTS_EXHAUSTED: claimed {command.claims - 1} times without a commit (limit {max_claims})"
    if command.last_error:
        reason += f"; last error: {command.last_error}"
    dead = HistoryEntry(
        "COMMAND_DEAD_LETTERED", instance.step, instance.visit, {"command": command.id, "kind": command.kind}
    )
    if command.kind == "SIGNAL":
        return Decision(Settle("DEAD", reason), history=(dead,))
    error = {"step": instance.step, "type": "DeadLetter", "message": reason}
    return Decision(
        Settle("DEAD", reason),
        instance=InstanceChange(FAILED, instance.step, instance.visit, wait=instance.wait, error=error),
        history=(dead, HistoryEntry("INSTANCE_FAILED", instance.step, instance.visit, error)),
    )


def advance(instance: InstanceView, change: InstanceChange | None) -> InstanceView:
    """The instance as a committed decision left it, without reading it back."""
    if change is None:
        return instance
    state = instance.state if change.state is None else change.state
    return InstanceView(instance.id, change.status, change.step, change.visit, state, change.wait)
