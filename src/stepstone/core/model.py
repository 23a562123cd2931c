"""The values the core reads and the decisions it returns.

The store turns rows into `InstanceView` and `CommandView`; the runtime hands the
core a `StepSucceeded` or `StepFailed` after running a handler; the store carries
out a `Decision` in one fenced commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, TypeVar

from stepstone.core.effects import Effect, EmitEvent, EndInstance, Enqueue
from stepstone.core.failures import Frame

JSON = Any
E = TypeVar("E", bound=Effect)

ROOT = ""
"""The root position's path; a branch's path nests under its fork (`ship/2`, `ship/2/notify/a`)."""

# Position statuses. A COMPLETED or CANCELLED position is closed; FAILED is retryable.
POSITION_CLOSED = frozenset({"COMPLETED", "CANCELLED"})

# Instance statuses. FAILED is not terminal: an operator may retry it.
PENDING = "PENDING"
RUNNING = "RUNNING"
WAITING = "WAITING"
COMPLETED = "COMPLETED"
FAILED = "FAILED"
CANCELLED = "CANCELLED"
# Sagas (core/saga.py): compensating, then COMPENSATED (a failure undone), CANCELLED or TIMED_OUT
# (by why it compensated); COMPENSATION_FAILED is not terminal: an operator may retry it.
COMPENSATING = "COMPENSATING"
COMPENSATED = "COMPENSATED"
TIMED_OUT = "TIMED_OUT"
COMPENSATION_FAILED = "COMPENSATION_FAILED"
TERMINAL = frozenset({COMPLETED, CANCELLED, COMPENSATED, TIMED_OUT})
STATUSES = (PENDING, RUNNING, WAITING, COMPLETED, FAILED, CANCELLED, COMPENSATING, COMPENSATED, TIMED_OUT,
            COMPENSATION_FAILED)
"""Every status an instance can have, in the order the CLI and the UI offer them as filters."""
MAY_RUN = tuple(s for s in STATUSES if s not in TERMINAL)
"""The statuses of an instance that may still run on its pinned version (a FAILED or COMPENSATION_FAILED one
once an operator retries it): the instances a batch migration moves, and those that hold back the
retirement of the version they pin."""

CommandKind = Literal["START", "STEP", "SIGNAL", "TIMER", "RETRY", "BRANCH_DONE", "CHILD_COMPLETION",
                      "EXTERNAL_COMPLETION", "COMPENSATE", "TASK_COMPLETION", "MESSAGE"]
RUNS_STEP = frozenset({"START", "STEP", "RETRY"})
"""Command kinds that execute the instance's current step."""

FAILURE_KINDS = frozenset({
    "STEP_FAILED", "INSTANCE_FAILED", "BRANCH_FAILED", "COMMAND_DEAD_LETTERED", "CHILD_FAILED",
    "EXTERNAL_TASK_FAILED", "EXTERNAL_TASK_ATTEMPT_FAILED", "COMPENSATION_ATTEMPT_FAILED", "COMPENSATION_FAILED",
    "DEADLINE_PASSED", "STEP_DEADLINE_PASSED", "STEP_DEADLINE_EXCEEDED",
})
"""History entries that record something going wrong: what a history of failures only shows (the CLI's
`history --failed`, the API's `failed_only`, the UI), one list for all of them."""

SettleState = Literal["COMPLETE", "PARKED", "REJECTED", "STALE", "DEAD", "FAILED", "RETRY"]


@dataclass(frozen=True)
class Parent:
    """Where a child instance reports its end: the parent, its position and that position's visit."""

    id: str
    position: str
    visit: int


@dataclass(frozen=True)
class Branch:
    """What a branch position knows of its fork: the fork's position and visit, its own name,
    and for a map fork the item it runs for."""

    parent: str
    visit: int
    name: str
    item: JSON = None


@dataclass(frozen=True)
class InstanceView:
    """An instance as the core sees it from one position: that position's step, visit and wait,
    the instance's status and shared JSON state (at `state_version`)."""

    id: str
    status: str
    step: str | None
    visit: int
    state: JSON
    wait: JSON = None
    position: str = ROOT
    position_status: str | None = None
    state_version: int = 0
    parent: Parent | None = None
    branch: Branch | None = None


@dataclass(frozen=True)
class CommandView:
    """A claimed command. `claims` counts claims since it was last settled or rescheduled."""

    id: int
    kind: str
    step: str | None = None
    visit: int | None = None
    name: str | None = None
    payload: JSON = None
    attempt: int = 1
    claims: int = 1
    last_error: str | None = None
    """The error its last settle, deferral or crashed segment recorded, for the dead letter."""
    actor: str | None = None
    """Who recorded it (`core.attribution`): the worker's history entries name it as on whose behalf."""
    behind: tuple[CommandView, ...] = ()
    """For a join's `BRANCH_DONE`: the ready commands queued right behind it on its position, in queue
    order, which its decision may carry out too (`SettleQueued`); empty for every other kind."""
    alone_claims: int = 0
    """How many earlier claims ran it alone in their worker and did not commit (`runtime/alone.py`): a
    crash counts on a command only by those (`core.dead_letter`)."""


@dataclass(frozen=True)
class Event:
    """An outbox event staged by a step, written in that step's commit."""

    type: str
    payload: JSON
    key: str | None = None

    def to_effect(self, index: int) -> EmitEvent:
        return EmitEvent(self.type, self.payload, self.key, index)


@dataclass(frozen=True)
class ChildStart:
    """What a child step's handler asked for: the child's pinned plan, first step and input, and the
    deadlines a start of its workflow gives (its default instance deadline, its action start step's)."""

    definition_id: str
    version: int
    plan_hash: str
    step: str
    state: JSON
    deadline_seconds: float | None = None
    start_deadline_seconds: float | None = None


@dataclass(frozen=True)
class StepSucceeded:
    """A handler returned: where it goes next, the state it left, the events it emitted, and for a
    child step the child to start."""

    next: str | None
    state: JSON
    events: tuple[Event, ...] = ()
    child: ChildStart | None = None
    recorded: JSON = None
    """What the step recorded for its compensation (`StepContext.record`)."""


@dataclass(frozen=True)
class StepFailed:
    """A handler raised. Only the error's type and message are kept, never payload values, and where it
    raised: the frames of its error (code, never values; `core.failures`) and of the errors it was chained to."""

    error_type: str
    message: str
    retryable: bool = True
    frames: tuple[Frame, ...] = ()
    frames_omitted: int = 0
    cause: JSON = None
    """The error it was raised from or while handling, as stored (`core.failures`); None when none."""


@dataclass(frozen=True)
class RunStep:
    """The claimed command runs the current action step's handler; call `complete_step` after."""

    step: str
    visit: int
    attempt: int


@dataclass(frozen=True)
class Settle:
    """What becomes of the claimed command. RETRY puts it back after `retry_delay` seconds."""

    state: SettleState
    reason: str | None = None
    retry_delay: float | None = None


@dataclass(frozen=True)
class Decision:
    """Everything one fenced commit writes, or nothing at all: the claimed command's settlement
    and the typed effects (`core.effects`)."""

    settle: Settle
    effects: tuple[Effect, ...] = ()

    def of(self, kind: type[E]) -> list[E]:
        """The effects of one type, in order."""
        return [e for e in self.effects if isinstance(e, kind)]

    def first(self, kind: type[E]) -> E | None:
        # Asked several times per step (the worker, the store, sagas, redaction) of an immutable tuple:
        # each kind is looked for once. The cache lives beside the fields, outside eq, hash and repr.
        found: dict[type[Effect], Effect | None] = self.__dict__.setdefault("_first", {})
        if kind not in found:
            found[kind] = next((e for e in self.effects if isinstance(e, kind)), None)
        return found[kind]  # type: ignore[return-value]

    @cached_property
    def continuation(self) -> Enqueue | None:
        return next((e for e in self.effects if isinstance(e, Enqueue) and e.continuation), None)

    @property
    def ended(self) -> bool:
        return self.first(EndInstance) is not None
