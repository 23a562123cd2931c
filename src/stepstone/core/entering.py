"""Arriving at a step: the effects of moving one position to `target`.

An action or child step queues its continuation; a timer, wait, fork or external
task makes the position wait; a join ends a branch and tells the fork's position; the end
completes the instance. Forks and joins keep their count on the fork position's
wait, which only that position's ordered commands change, so a join fires once.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Any

from stepstone.core.effects import (
    BranchStart,
    CloseBranches,
    Effect,
    EndInstance,
    Enqueue,
    IfStopped,
    MovePosition,
    OpenBranches,
    RecordHistory,
    RequeueSignals,
    ScheduleStepDeadline,
)
from stepstone.core.external_tasks import open_task
from stepstone.core.model import COMPLETED, FAILED, JSON, ROOT, RUNNING, WAITING, InstanceView, Settle
from stepstone.core.plan import END, Plan, Step
from stepstone.core.subscriptions import correlation_key, key_problem, subscribe
from stepstone.core.task_entering import dates_problem, enter_task, names_problem, task_people
from stepstone.core.timestamps import storable


def enter(
    instance: InstanceView,
    plan: Plan,
    target: str,
    state: JSON,
    now: datetime,
    *,
    cause: JSON = None,
    same_visit: bool = False,
) -> list[Effect]:
    """Move the position to `target` with `state`. `cause` (the signal or child end that led here)
    travels with the continuation, so the next handler sees it as `ctx.signal` / `ctx.child`."""
    visit = instance.visit if same_visit else instance.visit + 1
    if target == END:
        if instance.branch is not None:
            return fail(instance, "InvalidTransition", "a branch cannot end the instance", visit=visit)
        return [
            MovePosition(COMPLETED, None, visit),
            EndInstance(COMPLETED),
            RecordHistory("INSTANCE_COMPLETED", None, visit),
        ]
    step = plan.steps[target]
    entered = _enter_step(instance, plan, step, visit, state, now, cause)
    if step.deadline_seconds is not None and _arrives(entered, target):
        entered.append(ScheduleStepDeadline(target, visit, step.deadline_seconds))
    return entered


def _arrives(effects: list[Effect], target: str) -> bool:
    """The position stays at `target` (entering it did not fail at once)."""
    return any(isinstance(e, MovePosition) and e.step == target and e.status != FAILED for e in effects)


def _enter_step(  # noqa: PLR0911 - one return per step kind
    instance: InstanceView, plan: Plan, step: Step, visit: int, state: JSON, now: datetime, cause: JSON,
) -> list[Effect]:
    target = step.name
    if step.kind in ("action", "child"):
        return [
            MovePosition(RUNNING, target, visit),
            Enqueue("STEP", target, visit, payload=cause, continuation=True),
        ]
    if step.kind == "timer":
        return _timer(instance, step, visit, state, now)
    if step.kind == "wait":
        key = correlation_key(step, state)
        if (problem := key_problem(step, key)) is not None:
            return fail(instance, "InvalidCorrelation", problem, step=target, visit=visit)
        wait = {"kind": "signal", "signals": dict(step.signals), "timeout_seconds": step.timeout_seconds}
        if step.messages:
            wait["messages"] = dict(step.messages)
            if key is not None:  # what a publisher must give: `show` and the history say it
                wait["correlation_key"] = key
        timeout = [] if step.timeout_seconds is None else [
            Enqueue("TIMER", target, visit, name="timeout", delay=step.timeout_seconds),
        ]
        return [
            MovePosition(WAITING, target, visit, wait=wait),
            RecordHistory("WAITING", target, visit, wait),
            *timeout,
            RequeueSignals(tuple(sorted(step.signals))),
            *subscribe(step, visit, key),
        ]
    if step.kind == "task":
        people = task_people(instance, step, state)
        if (problem := names_problem(step, people) or dates_problem(step, state, now)) is not None:
            return fail(instance, "InvalidTask", problem, step=target, visit=visit)
        return enter_task(instance, step, visit, state, now, people)
    if step.kind == "fork":
        return _fork(instance, plan, step, visit, state, now)
    if step.kind == "external":
        return open_task(instance, step, visit, state)
    return _reach_join(instance, step, visit)


def _timer(instance: InstanceView, step: Step, visit: int, state: JSON, now: datetime) -> list[Effect]:
    at = None
    if step.until is not None:
        at = _instant(state, step.until, now)
        if at is None:
            problem = (f"timer step {step.name!r}: state field {step.until!r} is not an ISO 8601 instant with a zone "
                       "(years 1 to 9999 in UTC)")
            return fail(instance, "InvalidTimer", problem, step=step.name, visit=visit)
    timer: dict[str, Any] = {"kind": "timer", "delay_seconds": step.delay_seconds, "until": at}
    return [
        MovePosition(WAITING, step.name, visit, wait=timer),
        RecordHistory("WAITING", step.name, visit, timer),
        Enqueue("TIMER", step.name, visit, name="fire", delay=step.delay_seconds, at=at),
    ]


def _fork(instance: InstanceView, plan: Plan, step: Step, visit: int, state: JSON, now: datetime) -> list[Effect]:
    join = plan.join_of(step.name)
    prefix = branch_prefix(instance.position, step.name)
    if step.branches:
        starts = [BranchStart(prefix + name, first, name) for name, first in step.branches.items()]
    else:
        items = state.get(step.map_over) if isinstance(state, dict) else None
        if not isinstance(items, list):
            got = type(items).__name__ if items is not None else "nothing"
            problem = f"fork step {step.name!r} maps over state field {step.map_over!r}, which holds {got}, not a list"
            return fail(instance, "InvalidMap", problem, step=step.name, visit=visit)
        if len(items) > step.max_items:
            problem = f"fork step {step.name!r} maps over {len(items)} items; the limit is {step.max_items}"
            return fail(instance, "InvalidMap", problem, step=step.name, visit=visit)
        first = step.branch_step or ""
        starts = [BranchStart(f"{prefix}{n}", first, str(n), item) for n, item in enumerate(items)]
    total = len(starts)
    need = total if join.need == 0 else min(join.need, total)
    started = RecordHistory("FORK_STARTED", step.name, visit, {"branches": total, "need": need})
    if total == 0:  # nothing to wait for: straight on past the join
        at_fork = replace(instance, step=step.name, visit=visit)
        return [started, *enter(at_fork, plan, join.next[0], state, now)]
    wait = {"kind": "join", "fork": step.name, "join": join.name, "total": total, "need": need, "done": 0}
    return [MovePosition(WAITING, step.name, visit, wait=wait), started, OpenBranches(tuple(starts), visit),
            *_branch_deadlines(plan, starts)]


def _branch_deadlines(plan: Plan, starts: list[BranchStart]) -> list[Effect]:
    """A branch's first step is not entered: its STEP command runs an action's handler at once, as a
    start does (`Plan.start_deadline`), so the fork schedules an action's deadline. A wait or a timer
    schedules its own when that STEP enters it."""
    return [ScheduleStepDeadline(b.step, None, seconds, position=b.path) for b in starts
            if plan.steps[b.step].kind == "action" and (seconds := plan.steps[b.step].deadline_seconds) is not None]


def _reach_join(instance: InstanceView, join: Step, visit: int) -> list[Effect]:
    branch = instance.branch
    if branch is None:
        return fail(instance, "InvalidTransition", f"join {join.name!r} reached outside a branch", visit=visit)
    report = {"fork": join.fork, "branch": instance.position}
    return [
        MovePosition(COMPLETED, join.name, visit),
        RecordHistory("BRANCH_COMPLETED", join.name, visit, {"branch": branch.name}),
        Enqueue("BRANCH_DONE", join.fork, branch.visit, payload=report, position=branch.parent),
    ]


def join_branch(
    instance: InstanceView, plan: Plan, wait: dict[str, Any], branches: list[str], now: datetime
) -> list[Effect]:
    """Branches of the fork this position waits at reached the join, in the order they reported; the
    caller passes no more of them than the join still needs."""
    fork = str(wait["fork"])
    done, total, need = int(wait["done"]), int(wait["total"]), int(wait["need"])
    joined: list[Effect] = []
    for branch in branches:
        done += 1
        joined.append(RecordHistory("BRANCH_JOINED", fork, instance.visit,
                                    {"branch": branch, "done": done, "need": need}))
    if done < need:
        return [MovePosition(WAITING, fork, instance.visit, wait={**wait, "done": done}), *joined]
    losers = [CloseBranches(branch_prefix(instance.position, fork), "JOIN_COMPLETE")] if done < total else []
    join = plan.join_of(fork)
    fired = RecordHistory("JOINED", join.name, instance.visit, {"done": done, "total": total})
    return [*joined, *losers, fired, *enter(instance, plan, join.next[0], instance.state, now)]


def child_failed(instance: InstanceView, step: str, payload: dict[str, Any]) -> list[Effect]:
    error = payload.get("error") if isinstance(payload.get("error"), dict) else {}
    detail = error.get("message") if isinstance(error, dict) else None
    message = f"child {payload.get('child_id')} ended {payload.get('status')}" + (f": {detail}" if detail else "")
    return fail(instance, "ChildFailed", message, step=step)


def branch_prefix(position: str, fork: str) -> str:
    """Paths of a fork's branches start with this: `fork/` at the root, `a/1/fork/` nested."""
    return f"{position}/{fork}/" if position else f"{fork}/"


def fail(
    instance: InstanceView, error_type: str, message: str, *, step: str | None = None, visit: int | None = None
) -> list[Effect]:
    """The position fails: a clear error an operator can retry."""
    at, when = step or instance.step, instance.visit if visit is None else visit
    return failed(instance, at, when, {"step": at, "type": error_type, "message": message})


def failed(instance: InstanceView, step: str | None, visit: int, error: JSON, wait: JSON = None) -> list[Effect]:
    """This position fails for good. The root's failure fails the instance. A branch's fails it only when
    its join can no longer be met without the branch (a join that needs all of them: at once); while it
    still can, the other branches go on and the history says BRANCH_FAILED (`IfStopped`)."""
    moved = MovePosition(FAILED, step, visit, wait=wait, error=error)
    stopped = RecordHistory("INSTANCE_FAILED", step, visit, error)
    if instance.position == ROOT:
        return [moved, stopped]
    return [moved, IfStopped((stopped,), (RecordHistory("BRANCH_FAILED", step, visit, error),))]


def settled(effects: list[Effect]) -> Settle:
    """The claimed command's settlement says what happened: FAILED when the position failed."""
    failed = next((e for e in effects if isinstance(e, MovePosition) and e.status == FAILED), None)
    if failed is None:
        return Settle("COMPLETE")
    error = failed.error or {}
    return Settle("FAILED", f"{error.get('type')}: {error.get('message')}")


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
    at = max(parsed, now)
    # An instant past year 9999 in UTC: PostgreSQL stored such a timer, and then the driver could read
    # neither it nor its instance (OverflowError). One before year 1 is in the past: now, like any other.
    return at.isoformat() if storable(at) else None
