"""What a workflow's handlers receive and declare with: the step's context (`StepContext`,
`CompensationContext`), the signal, child, external-task and task outcomes it carries, retry
policies, and the `from_state` / `from_item` references a step's arguments may take.

Split out of `workflow.py` (which builds the plan from these declarations); it re-exports them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from stepstone.core.model import Event
from stepstone.core.plan import RetryPolicy
from stepstone.errors import DefinitionError

log = logging.getLogger("stepstone.authoring")


@dataclass(frozen=True)
class Retry:
    """Retry policy of an action step: attempts, exponential backoff, errors never retried."""

    max_attempts: int = 3
    backoff: float | timedelta = 1.0
    multiplier: float = 2.0
    max_backoff: float | timedelta = 60.0
    non_retryable: tuple[type[BaseException], ...] = ()

    def __post_init__(self) -> None:
        # Checked here, when the workflow is defined: a list of classes was kept as given and each failure
        # of the step then crashed the worker in isinstance(); a bare class or a name failed elsewhere.
        given: Any = self.non_retryable
        classes = (given,) if isinstance(given, type) else tuple(given) if isinstance(given, list | tuple) else None
        if classes is None or not all(isinstance(c, type) and issubclass(c, BaseException) for c in classes):
            raise DefinitionError(f"Retry(non_retryable=...) takes exception classes, got {given!r}")
        object.__setattr__(self, "non_retryable", classes)
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise DefinitionError(f"Retry(max_attempts=...) takes a whole number, got {self.max_attempts!r}")
        if isinstance(self.multiplier, bool) or not isinstance(self.multiplier, int | float):
            raise DefinitionError(f"Retry(multiplier=...) takes a number, got {self.multiplier!r}")

    def policy(self) -> RetryPolicy:
        first, cap = _seconds(self.backoff), _seconds(self.max_backoff)
        if 0 <= cap < first:  # documented and kept (the plan's hash holds it), but easy to miss: say so now
            log.warning("Retry(backoff=%g s) waits at most max_backoff=%g s before each retry: give max_backoff= "
                        "to wait longer", first, cap)
        return RetryPolicy(
            max_attempts=self.max_attempts,
            initial_backoff=first,
            multiplier=self.multiplier,
            max_backoff=cap,
            non_retryable=tuple(sorted(_type_name(t) for t in self.non_retryable)),
        )


@dataclass(frozen=True)
class Signal:
    """The signal that moved the instance out of its last wait."""

    name: str
    payload: Any


@dataclass(frozen=True)
class ChildResult:
    """How the child workflow a child step waited for ended: COMPLETED (with its final state),
    FAILED or CANCELLED (with its error)."""

    instance_id: str
    status: str
    state: Any = None
    error: Any = None


@dataclass(frozen=True)
class ExternalResult:
    """How the external task the last step waited for was answered: `outcome` completed or error
    (a business error, with its `error`: code, message, details)."""

    task_id: str
    outcome: str
    error: Any = None


@dataclass(frozen=True)
class TaskOutcome:
    """How the human task that led to this step was completed: its id, the decision, the payload
    (JSON, validated against the decision's model) and who completed it."""

    id: str
    decision: str
    payload: Any
    actor: str | None


def from_state(path: str) -> dict[str, str]:
    """A task attribute computed from the instance's state when the task opens: the value at `path`
    (dotted), e.g. ``assignee=from_state("manager")``."""
    return {"state": path}


def from_item(path: str = "") -> dict[str, str]:
    """In a map branch, a task attribute read from the branch's item (the whole item by default),
    e.g. ``assignee=from_item()`` over a list of user names."""
    return {"item": path}


@dataclass(frozen=True)
class BranchInfo:
    """The branch a handler runs in: its name (a static branch's name, or a map item's index),
    its position path, and for a map fork the item it runs for."""

    name: str
    path: str
    item: Any = None


@dataclass
class StepContext:
    """What a handler knows about the step it runs.

    `idempotency_key` is the same on every attempt of this visit of this step, on
    any worker: hand it to the outside world so a repeated effect is recognised.
    """

    instance_id: str
    workflow: str
    step: str
    attempt: int
    idempotency_key: str
    signal: Signal | None = None
    child: ChildResult | None = None
    branch: BranchInfo | None = None
    external: ExternalResult | None = None
    events: list[Event] = field(default_factory=list)
    task: TaskOutcome | None = None
    recorded: Any = None
    """What `record` kept for this step's compensation."""

    def record(self, value: Any) -> None:
        """Keep `value` (JSON) with this step's completion: its compensation handler gets it."""
        self.recorded = value

    def emit(self, type: str, payload: Any, *, key: str | None = None) -> None:  # noqa: A002 - the event's type
        """Stage an outbox event; it is written in this step's commit, or not at all."""
        self.events.append(Event(type, payload, key))


@dataclass
class CompensationContext:
    """What a compensation handler knows: the step it undoes, why (`cause`: failed, cancelled or
    timed_out) and which attempt this is. `idempotency_key` is the same on every attempt of this
    compensation, on any worker."""

    instance_id: str
    workflow: str
    step: str
    position: str
    attempt: int
    idempotency_key: str
    cause: str | None = None
    events: list[Event] = field(default_factory=list)

    def emit(self, type: str, payload: Any, *, key: str | None = None) -> None:  # noqa: A002 - the event's type
        """Stage an outbox event; it is written in this compensation's commit, or not at all."""
        self.events.append(Event(type, payload, key))

def _seconds(value: timedelta | float) -> float:
    """A duration given when a workflow is defined, in seconds; anything but a number or a timedelta is a
    DefinitionError then (float("soon") was a bare ValueError)."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DefinitionError(f"a duration is seconds (a number) or a timedelta, got {value!r}")
    return float(value)


def _type_name(t: type[BaseException]) -> str:
    return t.__name__
