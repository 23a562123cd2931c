"""Typed results of the operations: what the CLI prints, the HTTP API returns and the client hands back."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from stepstone.core.attribution import Actor

__all__ = [
    "BulkItem",
    "BulkReport",
    "HistoryEntry",
    "HistoryPage",
    "InstanceDetail",
    "InstancePage",
    "InstanceSummary",
    "ProbeReport",
    "ReplayResult",
    "RetentionReport",
    "Retrying",
    "StuckItem",
    "StuckReport",
]


def _plain(value: Any) -> Any:
    if isinstance(value, Actor):
        return value.as_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class _Plain:
    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (datetimes stay datetimes; `json.dumps(default=str)` prints them)."""
        out = _plain(self)
        assert isinstance(out, dict)
        return out


@dataclass(frozen=True)
class HistoryEntry(_Plain):
    """One decision or event of an instance: who, on which command, where, what came of it, and the
    RFC 6902 patch of the state change (None when the entry changed no state, or was logged as a
    baseline: then `data['state']` holds the whole state)."""

    seq: int
    at: datetime
    kind: str
    position: str
    step: str | None
    visit: int | None
    command_id: int | None
    command_kind: str | None
    actor: Actor | None
    outcome: str
    patch: list[Any] | None
    data: Any


@dataclass(frozen=True)
class HistoryPage(_Plain):
    entries: list[HistoryEntry]
    next_after: int | None
    """Pass as `after` for the next page; None on the last one."""


@dataclass(frozen=True)
class InstanceSummary(_Plain):
    id: str
    scope: str
    workflow: str
    version: int
    status: str
    step: str | None
    business_key: str | None
    parent_id: str | None
    created_at: datetime
    updated_at: datetime
    ended_at: datetime | None
    archived_at: datetime | None


@dataclass(frozen=True)
class InstancePage(_Plain):
    items: list[InstanceSummary]
    next_after: tuple[datetime, str] | None
    """(created_at, id) of the last row, for the next page; None on the last one."""


@dataclass(frozen=True)
class Retrying(_Plain):
    """A step waiting out its retry backoff."""

    position: str
    step: str | None
    attempt: int
    max_attempts: int | None
    next_at: datetime
    last_error: str | None

    def describe(self) -> str:
        of = f" of {self.max_attempts}" if self.max_attempts else ""
        where = f" (branch {self.position})" if self.position else ""
        return f"retrying step {self.step}{where}, attempt {self.attempt}{of}, next at {self.next_at.isoformat()}"


@dataclass(frozen=True)
class InstanceDetail(InstanceSummary):
    """Everything about one instance: its state (sensitive values redacted), every position and what
    it waits for, open commands, timers, children, outbox events, and any retry in progress."""

    state: Any = None
    error: Any = None
    positions: list[dict[str, Any]] = field(default_factory=list)
    commands: list[dict[str, Any]] = field(default_factory=list)
    timers: list[dict[str, Any]] = field(default_factory=list)
    children: list[dict[str, Any]] = field(default_factory=list)
    outbox: list[dict[str, Any]] = field(default_factory=list)
    retrying: list[Retrying] = field(default_factory=list)


@dataclass(frozen=True)
class ProbeReport(_Plain):
    """The execution probe: `idle` when nothing is in flight and nothing is claimable now."""

    instance_id: str | None
    idle: bool
    in_flight: list[dict[str, Any]]
    claimable: list[dict[str, Any]]
    deferred: list[dict[str, Any]]
    parked: list[dict[str, Any]]
    waiting: list[dict[str, Any]]
    """Other PENDING commands not claimable now: future timers, queued behind another."""
    more: bool = False
    """A list was cut at `queries.MAX_REPORT` (of the oldest instances): more commands are open than listed.
    `idle` is read whole either way."""


@dataclass(frozen=True)
class StuckItem(_Plain):
    command_id: int
    instance_id: str
    workflow: str
    instance_status: str
    position: str
    kind: str
    state: str
    step: str | None
    attempt: int
    reason: str
    """'dead letter', 'retrying' or 'old' (open for longer than the threshold)."""
    since: datetime
    available_at: datetime
    last_error: str | None


@dataclass(frozen=True)
class StuckReport(_Plain):
    older_than_seconds: float
    items: list[StuckItem]
    more: bool = False
    """More commands are stuck than the report holds (`queries.MAX_REPORT`, of the oldest instances)."""

    def count(self, reason: str) -> int:
        return sum(1 for i in self.items if i.reason == reason)


@dataclass
class RetentionReport(_Plain):
    """What a retention run did (or, dry, would do); `held_*` and `skipped_*` say what it left and why."""

    dry_run: bool
    ran: bool = True
    """False when another sweep held the retention lock: nothing was done."""
    archived: int = 0
    purged: int = 0
    outbox_purged: int = 0
    messages_expired: int = 0
    """Buffered messages past their TTL, marked EXPIRED (their payloads dropped)."""
    skipped_busy: int = 0
    skipped_active: int = 0
    held_unsent: int = 0
    """Left unpurged: it holds an event the relay has not published yet."""
    held_dead: int = 0
    """Left unpurged: it holds a dead-lettered event (requeue or resolve it first)."""
    batches: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class BulkItem(_Plain):
    id: str
    ok: bool
    outcome: str
    status: str | None
    reason: str | None = None


@dataclass
class BulkReport(_Plain):
    """A bulk retry or cancel: how many matched, and what became of each one."""

    action: str
    dry_run: bool
    matched: int = 0
    succeeded: int = 0
    failed: int = 0
    items: list[BulkItem] = field(default_factory=list)


@dataclass(frozen=True)
class ReplayResult(_Plain):
    id: str
    from_step: str
    from_seq: int
    visit: int
    status: str
    state: Any
    """The state the step runs on again (sensitive values redacted)."""
    requested_step: str = ""
    """The step asked for: `from_step` is the root fork that opened its branch when it ran in one."""
