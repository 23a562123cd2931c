"""Typed effects: what one decision asks the commit to write.

The core answers a command with `Decision(settle, effects)`. Each effect is one
frozen dataclass; the store maps every effect type to its SQL in one place
(`store/effects.py`) and carries them all out in one fenced commit, in lock order.
A new feature adds an effect type, its SQL and its tests; the decision's shape
stays the same.

"This position" is the position that holds the claimed command.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stepstone.core.patch import changes, diff

JSON = Any


class Effect:
    """Base of every effect type."""

    __slots__ = ()


@dataclass(frozen=True)
class MovePosition(Effect):
    """This position's new place: RUNNING at an action step, WAITING at a timer, wait, join or
    child, COMPLETED (a branch that reached its join), or FAILED (with `error`)."""

    status: str
    step: str | None
    visit: int
    wait: JSON = None
    error: JSON = None


@dataclass(frozen=True)
class SetState(Effect):
    """The instance's new shared state, and what the step changed to get there (`core.patch.changes`).
    On the state version the decision saw, the state is written as is; on a newer one (another
    position committed meanwhile), the changes are carried onto it when they touch other parts of
    it, and the commit is refused as a conflict when they touch the same parts."""

    state: JSON
    changes: tuple[JSON, ...] = ()


def state_change(before: JSON, after: JSON, ops: list[dict[str, Any]] | None = None) -> tuple[Effect, ...]:
    """The SetState of a decision that turns `before` into `after`, or nothing when they are the same
    JSON document. `ops` is `diff(before, after)` when the caller has computed it already (a step's
    history patch is the same diff): the state is diffed once per commit."""
    ops = diff(before, after) if ops is None else ops
    return (SetState(after, tuple(changes(before, after, ops))),) if ops else ()


@dataclass(frozen=True)
class RecordHistory(Effect):
    kind: str
    step: str | None = None
    visit: int | None = None
    data: JSON = None


@dataclass(frozen=True)
class Enqueue(Effect):
    """A command the commit inserts on this position (or on `position` of the same instance). A
    continuation is inserted already claimed by this worker, so it goes on without a claim."""

    kind: str
    step: str | None
    visit: int | None
    name: str | None = None
    payload: JSON = None
    delay: float | None = None
    at: str | None = None
    continuation: bool = False
    position: str | None = None


@dataclass(frozen=True)
class SettleQueued(Effect):
    """Commands queued right behind the claimed one on this position that the decision carried out
    with it (a join's `BRANCH_DONE` reports, `CommandView.behind`): settled COMPLETE by the same commit,
    which the position's lease fences, so none of them is ever applied twice."""

    command_ids: tuple[int, ...]


@dataclass(frozen=True)
class CloseTimers(Effect):
    """Leaving a wait or timer: this position's pending timer commands are superseded."""


@dataclass(frozen=True)
class RequeueSignals(Effect):
    """Entering a wait: this position's earliest parked signal among `names` is offered again."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class BranchStart:
    """One branch of a fork: its path, first step, and what its handlers see as `ctx.branch`."""

    path: str
    step: str
    name: str
    item: JSON = None


@dataclass(frozen=True)
class OpenBranches(Effect):
    """A fork: one new position per branch, each with a STEP command any worker may claim.
    `visit` is the fork position's visit, which the branches report back to."""

    branches: tuple[BranchStart, ...]
    visit: int


@dataclass(frozen=True)
class CloseBranches(Effect):
    """Cancel the live branch positions under `prefix` (nested ones too): their open commands are
    cancelled, and their children too unless abandoned by policy."""

    prefix: str
    reason: str


@dataclass(frozen=True)
class EndInstance(Effect):
    """The instance reached its end: leftover commands are rejected, positions closed."""

    status: str


@dataclass(frozen=True)
class EmitEvent(Effect):
    """An outbox event, written in this commit; `index` makes its id stable across retries."""

    type: str
    payload: JSON
    key: str | None = None
    index: int = 0


@dataclass(frozen=True)
class StartChild(Effect):
    """Start a child instance (its id derived from this position's step visit, so a re-run
    never starts a second one) pinned to the given plan, with the parent link."""

    id: str
    definition_id: str
    version: int
    plan_hash: str
    state: JSON
    step: str
    cancel_with_parent: bool = True
    deadline_seconds: float | None = None
    start_deadline_seconds: float | None = None


@dataclass(frozen=True)
class RedactClaimedPayload(Effect):
    """The claimed command's payload as it may be kept once this commit settles it: the sensitive
    values of the signal, message or task decision it carried replaced (`core.redaction`). The
    claimed command's own row changes, which the commit holds already, and for a task completion the
    task row's copy (`task_payload`), which the commit's task section holds."""

    payload: JSON
    task_id: str | None = None
    task_payload: JSON = None


@dataclass(frozen=True)
class NotifyParent(Effect):
    """This instance ended or failed: a CHILD_COMPLETION command for the parent's position."""

    parent_id: str
    position: str
    visit: int
    payload: JSON


@dataclass(frozen=True)
class IfStopped(Effect):
    """What a branch's failure writes depends on whether it stops the instance, which only the commit
    can tell: `stopped` (the INSTANCE_FAILED entry, a child's report to its parent) when its join can
    no longer be met without it, `passed` (a BRANCH_FAILED entry) while it still can. Sibling branches
    fail and arrive while this one runs, so the decision cannot count them; the commit counts them under
    the instance's lock (docs/branches.md, "A branch that fails"). Holds RecordHistory and NotifyParent
    effects only."""

    stopped: tuple[Effect, ...]
    passed: tuple[Effect, ...] = ()


@dataclass(frozen=True)
class OpenExternalTask(Effect):
    """An external task for outside workers on `topic`, opened at this position's step visit (its id
    derived from them, so entering the step again at the same visit, a retry, re-opens the same task
    with fresh retries and any old lock fenced out). `retries` failures are allowed before an incident;
    `backoff` is the retry policy's delays (initial_backoff, multiplier, max_backoff)."""

    task_id: str
    topic: str
    step: str
    visit: int
    payload: JSON
    retries: int
    backoff: JSON


@dataclass(frozen=True)
class RecordCompensable(Effect):
    """A step that declares a compensation completed: it is remembered, with what it recorded, in
    the order of completion, so a saga can undo it later (`core.saga`)."""

    step: str
    visit: int
    recorded: JSON = None


@dataclass(frozen=True)
class AdvanceSaga(Effect):
    """The saga moves on (`core.saga`). `begin` (`cause` failed, cancelled or timed_out) closes every
    other position, settles their open commands and queues the compensation of the step completed
    last; `done` marks `record` compensated and queues the next, or ends the instance when none is
    left; `attempt_failed` notes an attempt that will be retried; `exhausted` stops the saga:
    COMPENSATION_FAILED, retryable by an operator; `compensate_child` asks the completed `child`
    of `record` to compensate itself and report back."""

    op: str
    cause: str | None = None
    record: int | None = None
    attempts: int | None = None
    error: JSON = None
    child: str | None = None


@dataclass(frozen=True)
class ScheduleStepDeadline(Effect):
    """Entering a step with a deadline: a timer on the saga's position (`core.saga.SAGA`), so a
    handler still running on the step's position does not hold it up. The step is this position's at
    `visit`, or, with `position`, the first step of a branch this commit opens (`OpenBranches`), at
    the visit the commit opens it at (`visit` None: a fork that runs again reopens its branches at
    their next visit, which only the store knows)."""

    step: str
    visit: int | None
    seconds: float
    position: str | None = None


@dataclass(frozen=True)
class InterruptStep(Effect):
    """A step deadline passed: when `position` is still running `step` at `visit`, its lease is taken
    (a handler still running commits nothing), STEP_DEADLINE_PASSED is recorded, its step commands are
    settled, and a TIMER `step_deadline` is queued on it, which moves it on (`on_deadline`) or fails the
    step. A position that left that visit in time is left alone, and nothing is recorded."""

    position: str
    step: str
    visit: int


@dataclass(frozen=True)
class WithinStepDeadline(Effect):
    """This commit is of a handler's run of `step` at `visit` of this position, a step with a deadline, or
    (with `late_settle`) of a signal, message or timer leaving that step, a wait or timer. When that
    deadline has passed and its timer has not fired (no slot was free to claim it), the deadline wins:
    nothing of the decision is written, the step is interrupted there as the timer would have done
    (`InterruptStep`), and the commit is refused (fenced). The due instant is the timer's: the store reads
    it only for such a commit. A command leaving a wait is then settled `late_settle` (a signal or message
    PARKED, kept for a later wait, a timer STALE) with `late_reason` and the `late_history` entries, as
    the wait's leaving would settle it: also when the timer's worker interrupts the step, or already has
    (its TIMER queued on this position, behind this command), so that the deadline still wins."""

    step: str
    visit: int
    late_settle: str | None = None
    late_reason: str | None = None
    late_history: tuple[RecordHistory, ...] = ()


@dataclass(frozen=True)
class OpenTask(Effect):
    """A human task opens at this position's visit: `task` is its resolved document (id, title,
    assignee, candidates, decisions, form, data shown, dates), written as a row in this commit."""

    task: JSON


@dataclass(frozen=True)
class ChangeTask(Effect):
    """A task of this position changes in this commit. `op`: complete, expire (both close it),
    reopen (a refused completion gives it back), escalate (`data`: the new assignee or group),
    remind."""

    task_id: str
    op: str
    data: JSON = None


@dataclass(frozen=True)
class Subscribe(Effect):
    """Entering a wait that takes messages: one open subscription per name for correlation `key` at
    `visit`. The oldest buffered message that matches is delivered in the same commit."""

    names: tuple[str, ...]
    key: str
    visit: int
