"""The external-task side of the store (asyncpg): fetch and lock, extend, answer, list.

Every statement is a named query from `sql/external.sql` or a function of migration 0010;
`PostgresExternalTasks` shares the engine store's pool. `stepstone.external` is the service on top.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from stepstone.store.database import translate_errors
from stepstone.store.postgres import Listener, PostgresStore
from stepstone.store.queries import named_queries

__all__ = ["Answer", "LockedTask", "PostgresExternalTasks"]


@dataclass(frozen=True)
class LockedTask:
    """A task a worker holds: answer it with `id` and `lock_token` before `lock_until`."""

    id: str
    lock_token: str
    topic: str
    payload: Any
    lock_until: datetime
    instance_id: str
    position: str
    step: str
    visit: int
    definition_id: str
    version: int
    business_key: str | None
    retries: int
    """Failures still allowed before an incident."""
    attempts: int
    """Failures so far."""
    last_error: str | None
    created_at: datetime

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: times as ISO 8601."""
        out = dict(self.__dict__)
        out["lock_until"] = self.lock_until.isoformat()
        out["created_at"] = self.created_at.isoformat()
        return out


@dataclass(frozen=True)
class Answer:
    """What `answer_external_task` said (see migration 0010 for the outcomes)."""

    outcome: str
    command_id: int | None
    status: str | None
    available_at: datetime | None
    retries: int | None


class PostgresExternalTasks:
    """The external-task queries on a `PostgresStore`'s pool and schema."""

    def __init__(self, store: object) -> None:
        if not isinstance(store, PostgresStore):
            raise TypeError(f"external tasks need the PostgreSQL store, not {type(store).__name__}")
        self.store = store
        self.pool = store.pool
        self.url = store.url
        self.q = named_queries("external.sql", store.schema)
        self.channel = f"stepstone_external_{store.schema}"[:63]

    async def _fetch(self, name: str, *args: Any) -> list[asyncpg.Record]:
        with translate_errors(self.url):
            return await self.pool.fetch(self.q[name], *args)

    async def fetch(
        self, topics: Sequence[str], limit: int, lock_seconds: float, worker: str
    ) -> tuple[list[LockedTask], int]:
        """Lock up to `limit` fetchable tasks of `topics`; also how many stale ones it closed."""
        rows = await self._fetch("external_fetch", list(topics), limit, worker, lock_seconds)
        tasks = [
            LockedTask(str(r["id"]), str(r["lock_token"]), r["topic"], r["payload"], r["lock_until"],
                       str(r["instance_id"]), r["position"], r["step"], r["visit"], r["definition_id"],
                       r["version"], r["business_key"], r["retries"], r["attempts"], r["last_error"],
                       r["created_at"])
            for r in rows if r["locked"]
        ]
        return tasks, sum(1 for r in rows if not r["locked"])

    async def extend(self, task_id: uuid.UUID, token: uuid.UUID, lock_seconds: float) -> tuple[str, datetime | None,
                                                                                                 str | None]:
        """(outcome, new lock expiry, status): extended, not_found, lock_lost, not_open or lock_expired."""
        [row] = await self._fetch("external_extend", task_id, token, lock_seconds)
        return row["outcome"], row["lock_until"], row["status"]

    async def answer(
        self, task_id: uuid.UUID, token: uuid.UUID, outcome: str, *, variables: Any, error: Any,
        retries: int | None, retry_delay: float | None, worker: str | None,
    ) -> Answer:
        [row] = await self._fetch("external_answer", task_id, token, outcome, variables, error, retries,
                                  retry_delay, worker)
        return Answer(row["outcome"], row["command_id"], row["status"], row["available_at"], row["retries"])

    async def list(
        self, *, topic: str | None, status: str | None, instance_id: uuid.UUID | None, limit: int,
        after: tuple[datetime, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Tasks oldest first, after the row whose (created_at, id) is `after`."""
        at, last = after if after is not None else (None, None)
        rows = await self._fetch("external_list", topic, status, instance_id, limit, at, last)
        return [{**dict(r), "id": str(r["id"]), "instance_id": str(r["instance_id"])} for r in rows]

    async def listen(self, callback: Callable[[], None]) -> Listener:
        """A dedicated connection LISTENing for tasks that became fetchable."""
        return await self.store.listen(callback, self.channel)
