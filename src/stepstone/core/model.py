"""The values the core reads and the decisions it returns.

The store turns rows into `InstanceView` and `CommandView`; the runtime hands the
core a `StepSucceeded` or `StepFailed` after running a handler; the store carries
out a `Decision` in one fenced commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

JSON = Any

# Instance statuses. FAILED is not terminal: an operator may retry it.
PENDING = "PENDING"
RUNNING = "RUNNING"
WAITING = "WAITING"
COMPLETED = "COMPLETED"
FAILED = "FAILED"
CANCELLED = "CANCELLED"
TERMINAL = frozenset({COMPLETED, CANCELLED})

CommandKind = Literal["START", "STEP", "SIGNAL", "TIMER", "RETRY"]
RUNS_STEP = frozenset({"START", "STEP", "RETRY"})
"""Command kinds that execute the instance's current step."""

SettleState = Literal["COMPLETE", "PARKED", "REJECTED", "STALE", "DEAD", "FAILED", "RETRY"]


@dataclass(frozen=True)
class InstanceView:
    """An instance as the core sees it: position, status and JSON state."""

    id: str
    status: str
    step: str | None
    visit: int
    state: JSON
    wait: JSON = None


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


@dataclass(frozen=True)
class Event:
    """An outbox event staged by a step, written in that step's commit."""

    type: str
    payload: JSON
    key: str | None = None


@dataclass(frozen=True)
class StepSucceeded:
    """A handler returned: where it goes next, the state it left, the events it emitted."""

    next: str | None
    state: JSON
    events: tuple[Event, ...] = ()


@dataclass(frozen=True)
class StepFailed:
    """A handler raised. Only the error's type and message are kept, never payload values."""

    error_type: str
    message: str
    retryable: bool = True


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
class NewCommand:
    """A command the commit inserts. A continuation is inserted already claimed by this worker."""

    kind: CommandKind
    step: str | None
    visit: int | None
    name: str | None = None
    payload: JSON = None
    delay: float | None = None
    at: str | None = None
    continuation: bool = False


@dataclass(frozen=True)
class HistoryEntry:
    kind: str
    step: str | None = None
    visit: int | None = None
    data: JSON = None


@dataclass(frozen=True)
class InstanceChange:
    """The instance's new position. `state` None leaves the stored state as it is."""

    status: str
    step: str | None
    visit: int
    wait: JSON = None
    state: JSON = None
    error: JSON = None


@dataclass(frozen=True)
class Decision:
    """Everything one fenced commit writes, or nothing at all."""

    settle: Settle
    instance: InstanceChange | None = None
    history: tuple[HistoryEntry, ...] = ()
    commands: tuple[NewCommand, ...] = ()
    events: tuple[Event, ...] = ()
    close_timers: bool = False
    """Leaving a wait or timer: its pending timer commands are superseded."""
    requeue_signals: tuple[str, ...] = ()
    """Entering a wait: the earliest parked signal among these names is offered again."""
    ended: bool = False
    """The instance reached a terminal status: parked commands are rejected."""

    @property
    def continuation(self) -> NewCommand | None:
        return next((c for c in self.commands if c.continuation), None)
