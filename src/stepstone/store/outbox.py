"""The outbox side of the store: what the relay, the CLI and retention need (asyncpg).

Every statement is a named query from `sql/outbox.sql`. `OutboxStore` is the port the relay depends
on; `PostgresOutbox` is its adapter, sharing the engine store's pool.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Protocol

import asyncpg

from stepstone.store.database import translate_errors
from stepstone.store.postgres import Listener, PostgresStore
from stepstone.store.queries import named_queries

__all__ = [
    "DeadLetter",
    "OutboxStatus",
    "OutboxStore",
    "PostgresOutbox",
    "Settlement",
    "StagedEvent",
]

Action = Literal["published", "retry", "dead", "release"]


@dataclass(frozen=True)
class StagedEvent:
    """An event as the relay leased it: what every publisher sends."""

    id: int
    event_id: str
    instance_id: str
    type: str
    key: str | None
    payload: Any
    created_at: datetime
    trace_context: dict[str, Any] | None = None
    attempts: int = 0


@dataclass(frozen=True)
class Settlement:
    """What became of one leased event; `counted` adds one to its attempts."""

    id: int
    action: Action
    error: str | None = None
    delay: float = 0.0
    counted: bool = False


@dataclass(frozen=True)
class OutboxStatus:
    """Pending (not published, not dead) events and how far behind the relay is."""

    pending: int
    in_flight: int
    backing_off: int
    above_horizon: int
    dead: int
    lag_seconds: float | None
    """Age of the oldest pending event on the db clock; None when nothing is pending."""
    oldest_pending_error: str | None = None
    """The oldest pending event's last error: why the outbox waits (a broker that refuses the publisher's
    setup holds every event as pending, with no attempt counted); None when it has none."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class DeadLetter:
    """An unpublished event as `stepstone outbox list` shows it."""

    id: int
    event_id: str
    instance_id: str
    type: str
    key: str | None
    attempts: int
    last_error: str | None
    created_at: datetime
    dead_at: datetime | None
    next_attempt_at: datetime | None
    claimed_by: str | None
    claimed_until: datetime | None
    state: str
    """'dead', 'in_flight', 'backing_off', 'above_horizon' or 'pending': what `status` counts it as
    (an expired lease or a retry time gone by is pending: any relay may claim it)."""
    behind_dead: bool
    """Pending, but an older event of its key is dead: it waits until that one is requeued."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class OutboxStore(Protocol):
    async def claim(self, limit: int, lease_seconds: float, relay: str, token: uuid.UUID) -> list[StagedEvent]: ...
    async def settle(self, token: uuid.UUID, settlements: Sequence[Settlement]) -> set[int]: ...
    async def status(self) -> OutboxStatus: ...
    async def listen(self, callback: Callable[[], None]) -> Listener: ...


class PostgresOutbox:
    """The outbox queries on a `PostgresStore`'s pool and schema (any store `open_store` built)."""

    def __init__(self, store: object) -> None:
        if not isinstance(store, PostgresStore):
            raise TypeError(f"the outbox needs the PostgreSQL store, not {type(store).__name__}")
        self.store = store
        self.pool = store.pool
        self.url = store.url
        self.schema = store.schema
        self.q = named_queries("outbox.sql", store.schema)
        self.channel = f"stepstone_outbox_{store.schema}"[:63]

    async def _fetch(self, name: str, *args: Any) -> list[asyncpg.Record]:
        with translate_errors(self.url):
            return await self.pool.fetch(self.q[name], *args)

    async def _fetchrow(self, name: str, *args: Any) -> asyncpg.Record | None:
        with translate_errors(self.url):
            return await self.pool.fetchrow(self.q[name], *args)

    async def claim(self, limit: int, lease_seconds: float, relay: str, token: uuid.UUID) -> list[StagedEvent]:
        """Lease up to `limit` events in staged order below the visibility horizon (see outbox.sql)."""
        rows = await self._fetch("outbox_claim", limit, lease_seconds, relay, token)
        return [
            StagedEvent(r["id"], str(r["event_id"]), str(r["instance_id"]), r["type"], r["key"], r["payload"],
                        r["created_at"], r["trace_context"], r["attempts"])
            for r in rows
        ]

    async def settle(self, token: uuid.UUID, settlements: Sequence[Settlement]) -> set[int]:
        """Record publishes, retries, dead letters and releases of a batch, fenced on its lease token."""
        if not settlements:
            return set()
        rows = await self._fetch(
            "outbox_settle", token, [s.id for s in settlements], [s.action for s in settlements],
            [s.error for s in settlements], [float(s.delay) for s in settlements],
            [s.counted for s in settlements],
        )
        return {int(r["id"]) for r in rows}

    async def status(self) -> OutboxStatus:
        r = await self._fetchrow("outbox_status")
        assert r is not None  # an aggregate always returns a row
        return OutboxStatus(r["pending"], r["in_flight"], r["backing_off"], r["above_horizon"], r["dead"],
                            r["lag_seconds"], r["oldest_pending_error"])

    async def published_count(self) -> int:
        with translate_errors(self.url):
            return int(await self.pool.fetchval(self.q["outbox_published_count"]))

    async def unpublished_beside(self, workflows: Sequence[str]) -> int:
        """How many unpublished events (pending or dead) belong to no instance of `workflows`."""
        with translate_errors(self.url):
            return int(await self.pool.fetchval(self.q["outbox_unpublished_beside"], list(workflows)))

    async def unpublished(self, *, dead: bool = False, limit: int = 50, after: int = 0) -> list[DeadLetter]:
        """Unpublished events oldest first (only dead letters when `dead`)."""
        rows = await self._fetch("outbox_list", dead, limit, after)
        return [
            DeadLetter(r["id"], str(r["event_id"]), str(r["instance_id"]), r["type"], r["key"], r["attempts"],
                       r["last_error"], r["created_at"], r["dead_at"], r["next_attempt_at"], r["claimed_by"],
                       r["claimed_until"], r["state"], bool(r["behind_dead"]))
            for r in rows
        ]

    async def requeue(self, ids: Sequence[int] = (), *, all_dead: bool = False) -> list[int]:
        """Dead events back to pending with their attempts reset; returns the ids requeued."""
        rows = await self._fetch("outbox_requeue", list(ids), all_dead)
        return sorted(int(r["id"]) for r in rows)

    async def discard(self, ids: Sequence[int] = (), *, all_dead: bool = False, reason: str) -> list[int]:
        """Dead events out of the outbox for good (never published; their keys resume); returns the ids."""
        rows = await self._fetch("outbox_discard", list(ids), all_dead, reason)
        return sorted(int(r["id"]) for r in rows)

    async def discarded_count(self) -> int:
        with translate_errors(self.url):
            return int(await self.pool.fetchval(self.q["outbox_discarded_count"]))

    async def summary(self) -> dict[str, Any]:
        """The status with the published and discarded counts: what `stepstone outbox status` and
        `GET /outbox/status` answer."""
        return {**(await self.status()).as_dict(), "published": await self.published_count(),
                "discarded": await self.discarded_count()}

    async def unsent_instances(self, candidates: Sequence[str] | None = None, *, limit: int = 10_000) -> set[str]:
        """The retention guard: of `candidates` (all instances when None), those holding an event that is
        not published yet, pending or dead. Retention must never purge one of these."""
        ids = None if candidates is None else [uuid.UUID(str(c)) for c in candidates]
        rows = await self._fetch("outbox_unsent_instances", ids, limit)
        return {str(r["instance_id"]) for r in rows}

    async def publish_times(self) -> list[tuple[str, datetime, datetime]]:
        """(event id, published_at, created_at) of every published event, in staged order."""
        rows = await self._fetch("outbox_publish_times")
        return [(str(r["event_id"]), r["published_at"], r["created_at"]) for r in rows]

    async def staged_order(self, event_ids: Sequence[str]) -> list[tuple[int, str, str, str | None]]:
        """(id, event id, type, key) of the given events in staged order: what per-key order is measured against."""
        rows = await self._fetch("outbox_events_by_id", [uuid.UUID(e) for e in event_ids])
        return [(int(r["id"]), str(r["event_id"]), r["type"], r["key"]) for r in rows]

    async def listen(self, callback: Callable[[], None]) -> Listener:
        """A dedicated connection LISTENing for staged events; `callback` runs on each notification."""
        return await self.store.listen(callback, self.channel)
