"""The PostgreSQL side of `TaskStore`: human tasks, correlated messages, start-or-signal.

Every statement is a named query of `sql/tasks.sql`; the inbox is composed of that file's
fragments, one mode and the filters, so each mode keeps a plan on its own indexes.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import asyncpg

from stepstone.errors import InstanceNotFound, OpenSignalLimit, TaskNotFound, Unavailable
from stepstone.store.database import translate_errors
from stepstone.store.queries import named_queries
from stepstone.store.task_port import TaskQuery

__all__ = ["TaskQueries", "open_signal_limit"]

OPEN_SIGNAL_LIMIT = "SC429"
"""The SQLSTATE of the open-signal cap (migration 0007, trigger commands_recorded)."""


@contextmanager
def open_signal_limit(instance_id: str | None) -> Iterator[None]:
    """The cap's refusal as the typed error."""
    try:
        yield
    except asyncpg.PostgresError as exc:
        if exc.sqlstate != OPEN_SIGNAL_LIMIT:
            raise
        limit = int(getattr(exc, "detail", None) or 0)
        raise OpenSignalLimit(str(exc).removeprefix("stepstone: ") + "; nothing was recorded",
                              instance_id=instance_id, limit=limit) from None

_MODES = {"inbox": "task_mode_inbox", "assigned": "task_mode_assigned", "candidate": "task_mode_candidate",
          "all": "task_mode_all"}
_BUSY_ATTEMPTS = 200
"""How often a publish tries again while a matching instance is busy committing (about 10 s in all: 2 ms
backing off to 50 ms; the database's publish_in_caller_transaction tries as often)."""


class TaskQueries:
    """Mixed into `PostgresStore` (which provides `pool`, `url` and `schema`)."""

    pool: asyncpg.Pool
    url: str
    schema: str

    @property
    def _tq(self) -> dict[str, str]:
        return named_queries("tasks.sql", self.schema)

    async def _task_fetch(self, name: str, *args: Any) -> list[asyncpg.Record]:
        with translate_errors(self.url):
            return await self.pool.fetch(self._tq[name], *args)

    async def _task_row(self, name: str, *args: Any) -> asyncpg.Record:
        rows = await self._task_fetch(name, *args)
        return rows[0]

    async def get_task(self, task_id: str) -> dict[str, Any]:
        rows = await self._task_fetch("get_task", _task_uuid(task_id))
        if not rows:
            raise TaskNotFound(task_id)
        return _plain(dict(rows[0]))

    def _inbox_sql(self, query: TaskQuery, *, count: bool) -> str:
        q = self._tq
        parts = [q["task_count" if count else "task_select"], q[_MODES[query.mode]], q["task_filters"]]
        if not count:
            parts.append(q["task_page"])
        return "\n".join(parts)

    def _inbox_args(self, query: TaskQuery) -> list[Any]:
        groups = None if query.groups is None else list(query.groups)
        if query.mode != "all" and groups is None:
            groups = []
        w = query.where
        return [query.user, groups, w.workflow, w.priority_at_least, w.due_before, w.candidate_group, w.text,
                w.follow_up_before, w.hide_later_follow_ups, w.scope, None if w.scopes is None else list(w.scopes)]

    async def list_tasks(self, query: TaskQuery) -> list[dict[str, Any]]:
        after = query.after
        page = [after[0], after[1], _task_uuid(after[2])] if after else [None, None, None]
        with translate_errors(self.url):
            rows = await self.pool.fetch(self._inbox_sql(query, count=False), *self._inbox_args(query), *page,
                                         query.limit)
        return [_plain(dict(r)) for r in rows]

    async def count_tasks(self, query: TaskQuery) -> int:
        with translate_errors(self.url):
            return int(await self.pool.fetchval(self._inbox_sql(query, count=True), *self._inbox_args(query)))

    async def instance_tasks(self, instance_id: str) -> list[dict[str, Any]]:
        try:
            iid = uuid.UUID(instance_id)
        except ValueError:
            raise InstanceNotFound(instance_id) from None
        return [_plain(dict(r)) for r in await self._task_fetch("instance_tasks", iid)]

    async def task_assign(
        self, task_id: str, op: str, *, to: str | None, actor: str, groups: Sequence[str], force: bool,
        reason: str, key: str | None, fingerprint: str,
    ) -> tuple[str, dict[str, Any] | None]:
        row = await self._task_row("task_assign", _task_uuid(task_id), op, to, actor, list(groups), force, reason,
                                   key, fingerprint)
        return str(row["outcome"]), row["task"]

    async def task_complete(
        self, task_id: str, decision: str, payload: Any, *, actor: str, groups: Sequence[str], force: bool,
        key: str | None, fingerprint: str, reviewed_version: int | None,
    ) -> tuple[str, dict[str, Any] | None, list[str]]:
        row = await self._task_row("task_complete", _task_uuid(task_id), decision, payload, actor, list(groups),
                                   force, key, fingerprint, reviewed_version)
        return str(row["outcome"]), row["task"], list(row["changed"] or [])

    async def task_key_seen(self, kind: str, task_id: str, key: str, fingerprint: str) -> str | None:
        seen = (await self._task_row("task_key_seen", kind, _task_uuid(task_id), key, fingerprint))["seen"]
        return None if seen is None else str(seen)

    async def task_reassign_all(
        self, from_user: str, to_user: str, *, actor: str, reason: str, dry_run: bool,
    ) -> tuple[int, int]:
        row = await self._task_row("task_reassign_all", from_user, to_user, actor, reason, dry_run)
        return int(row["reassigned"]), int(row["skipped"])

    async def publish_message(
        self, name: str, correlation_key: str, payload: Any, *, message_id: str | None, ttl: float | None,
        correlate_all: bool, fingerprint: str,
    ) -> dict[str, Any]:
        delay = 0.002
        for _ in range(_BUSY_ATTEMPTS):
            try:
                with open_signal_limit(None):
                    row = await self._task_row("publish_message", name, correlation_key, payload, message_id, ttl,
                                               correlate_all, fingerprint)
            except asyncpg.LockNotAvailableError:
                # A matching instance is committing: nothing was written; try again shortly.
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.05)
                continue
            return dict(row)
        raise Unavailable(f"message {name!r} ({correlation_key!r}): the matching instance stayed busy; "
                          "nothing was published, try again")

    async def start_or_signal(
        self, new: Any, signal: str, payload: Any, *, dedup_key: str | None, signal_fingerprint: str,
    ) -> dict[str, Any]:
        pin = new.pin
        with open_signal_limit(None):
            row = await self._task_row(
                "start_or_signal", uuid.UUID(new.id), pin.scope, pin.definition_id, pin.version, pin.plan_hash,
                new.state, new.start_step, new.business_key, new.fingerprint, new.actor, signal, payload, dedup_key,
                signal_fingerprint, new.context, new.deadline_at, new.deadline_seconds, new.start_deadline_seconds,
            )
        return dict(row)

    async def signal_started_instance(self, instance_id: str, dedup_key: str) -> bool:
        """Whether the start-or-signal call that recorded the instance's signal `dedup_key` started it."""
        return bool((await self._task_row("signal_started_instance", instance_id, dedup_key))["started"])

    async def save_task_filter(self, scope: str, owner: str, name: str, mode: str,
                               where: dict[str, Any]) -> dict[str, Any]:
        return dict(await self._task_row("save_task_filter", scope, owner, name, mode, where))

    async def task_filters(self, scope: str, owner: str) -> list[dict[str, Any]]:
        return [dict(r) for r in await self._task_fetch("saved_task_filters", scope, owner)]

    async def task_filter(self, scope: str, owner: str, name: str) -> dict[str, Any] | None:
        rows = await self._task_fetch("saved_task_filter", scope, owner, name)
        return dict(rows[0]) if rows else None

    async def delete_task_filter(self, scope: str, owner: str, name: str) -> bool:
        return bool(await self._task_fetch("delete_task_filter", scope, owner, name))


def _task_uuid(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise TaskNotFound(str(value)) from None


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """uuid columns as text, arrays as lists."""
    return {k: str(v) if isinstance(v, uuid.UUID) else list(v) if isinstance(v, tuple) else v
            for k, v in row.items()}
