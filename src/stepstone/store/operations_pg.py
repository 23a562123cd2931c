"""The PostgreSQL adapter of the operations port (`store/operations_port.py`), on a `PostgresStore`'s pool.

Every statement is a named query of `sql/operations.sql` (grants: `sql/grants.sql`).
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from stepstone.core.model import FAILURE_KINDS
from stepstone.errors import InstanceNotFound, InvalidInput
from stepstone.store.database import translate_errors
from stepstone.store.health import server_version_num
from stepstone.store.operations_port import InstanceFilter
from stepstone.store.postgres import PostgresStore
from stepstone.store.queries import named_queries
from stepstone.store.sqlfiles import quote_name, read_text, render

__all__ = ["PostgresOperations"]


def _id(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise InstanceNotFound(str(value)) from None


def _like(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def _filter_args(f: InstanceFilter) -> list[Any]:
    return [
        list(f.status) or None, f.workflow, f.version, f.scope, f.business_key,
        None if f.business_key_contains is None else _like(f.business_key_contains),
        None if f.parent is None else _id(f.parent), f.since, f.until, f.updated_since, f.updated_until,
        f.include_archived,
    ]


# The probe and the stuck report see archived instances too: an instance with work open is never
# archived, so one that shows is one a retry or a replay woke.
_EVERY = InstanceFilter(include_archived=True)


def _row(r: asyncpg.Record) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, uuid.UUID) else v) for k, v in r.items()}


class PostgresOperations:
    """The operations' queries on a `PostgresStore`'s pool and schema."""

    def __init__(self, store: object) -> None:
        if not isinstance(store, PostgresStore):
            raise TypeError(f"the operations need the PostgreSQL store, not {type(store).__name__}")
        self.store = store
        self.pool = store.pool
        self.url = store.url
        self.schema = store.schema
        self.q = named_queries("operations.sql", store.schema)

    async def _fetch(self, name: str, *args: Any) -> list[dict[str, Any]]:
        with translate_errors(self.url):
            return [_row(r) for r in await self.pool.fetch(self.q[name], *args)]

    async def _one(self, name: str, *args: Any) -> dict[str, Any]:
        rows = await self._fetch(name, *args)
        if not rows:
            raise InstanceNotFound(str(args[0]) if args else "")
        return rows[0]

    async def find_instances(
        self, where: InstanceFilter, after: tuple[datetime, str] | None, limit: int
    ) -> list[dict[str, Any]]:
        at, after_id = after if after else (None, None)
        return await self._fetch("find_instances", *_filter_args(where), at,
                                 None if after_id is None else _id(after_id), limit)

    async def count_instances(self, where: InstanceFilter) -> dict[str, int]:
        return {r["status"]: int(r["n"]) for r in await self._fetch("count_instances", *_filter_args(where))}

    async def instance(self, instance_id: str) -> dict[str, Any]:
        return await self.store.get(instance_id)

    async def instance_commands(self, instance_id: str) -> list[dict[str, Any]]:
        return await self._fetch("instance_commands", _id(instance_id))

    async def instance_outbox(self, instance_id: str) -> list[dict[str, Any]]:
        return await self._fetch("instance_outbox", _id(instance_id))

    async def instance_extra(self, instance_id: str) -> dict[str, Any]:
        return await self._one("instance_extra", _id(instance_id))

    async def retrying(self, instance_id: str) -> list[dict[str, Any]]:
        return await self._fetch("retrying", _id(instance_id))

    async def history_page(self, instance_id: str, after: int, limit: int, failed_only: bool) -> list[dict[str, Any]]:
        return await self._fetch("history_page", _id(instance_id), after, limit,
                                 sorted(FAILURE_KINDS) if failed_only else None)

    async def full_history(self, instance_id: str) -> list[dict[str, Any]]:
        return await self._fetch("full_history", _id(instance_id))

    async def open_commands(self, instance_id: str | None, limit: int,
                            where: InstanceFilter | None = None) -> list[dict[str, Any]]:
        return await self._fetch("open_commands", *_filter_args(where or _EVERY),
                                 None if instance_id is None else _id(instance_id), limit)

    async def busy_commands(self, instance_id: str | None, limit: int,
                            where: InstanceFilter | None = None) -> list[dict[str, Any]]:
        return await self._fetch("busy_commands", *_filter_args(where or _EVERY),
                                 None if instance_id is None else _id(instance_id), limit)

    async def stuck(self, older_than: timedelta, limit: int,
                    where: InstanceFilter | None = None) -> list[dict[str, Any]]:
        return await self._fetch("stuck", *_filter_args(where or _EVERY), older_than.total_seconds(), limit)

    async def retention_batch(self, phase: str, limit: int, after: str | None, dry_run: bool,
                              workflow: str | None = None, scope: str | None = None) -> dict[str, Any]:
        rows = await self._fetch("retention_batch", phase, limit, None if after is None else _id(after), dry_run,
                                 workflow, scope)
        row = rows[0]
        row["done_ids"] = [str(i) for i in row["done_ids"] or []]
        return row

    async def retention_outbox(self, limit: int, dry_run: bool) -> int:
        rows = await self._fetch("retention_outbox", limit, dry_run)
        return int(next(iter(rows[0].values())))

    async def retention_messages(self, limit: int, dry_run: bool) -> int:
        return int((await self._fetch("retention_messages", limit, dry_run))[0]["n"])

    async def retention_policies(self) -> list[dict[str, Any]]:
        return await self._fetch("retention_policies")

    async def set_retention_policy(
        self, workflow: str, status_class: str, retain_for: timedelta | None, purge_after: timedelta | None
    ) -> dict[str, Any]:
        try:
            rows = await self._fetch("set_retention_policy", workflow, status_class, retain_for, purge_after)
        except asyncpg.CheckViolationError:
            raise InvalidInput(f"unknown status class {status_class!r}; one of completed, failed, waiting, "
                               "outbox_published", what="status class") from None
        if not rows:
            raise InvalidInput(f"no workflow {workflow!r} is registered: a retention policy for it would never "
                               "apply (register a version first, or set the '*' default)", what="workflow")
        return rows[0]

    async def try_retention_lock(self) -> Any:
        """A connection holding the retention lock, or None when another sweep holds it."""
        with translate_errors(self.url):
            conn = await self.pool.acquire()
            try:
                if await conn.fetchval(self.q["retention_lock"], self.schema):
                    return conn
            except BaseException:
                await self.pool.release(conn)
                raise
            await self.pool.release(conn)
            return None

    async def release_retention_lock(self, holder: Any) -> None:
        try:
            with translate_errors(self.url):
                await holder.fetchval(self.q["retention_unlock"], self.schema)
        finally:
            await self.pool.release(holder)

    async def retry_many(self, ids: list[str], actor: str | None) -> list[dict[str, Any]]:
        """One row per id; a child refused because its parent no longer awaits it (outcome not_awaited) carries
        `parent`, what the refusal says of that parent (read after the batch)."""
        rows = await self._fetch("retry_many", [_id(i) for i in ids], actor)
        for row in rows:
            if row["outcome"] == "not_awaited":
                row["parent"] = (await self._fetch("parent_of_child", _id(row["id"])) or [{}])[0]
        return rows

    async def cancel_many(
        self, ids: list[str], reason: str, actor: str | None, compensate: bool = False,
    ) -> list[dict[str, Any]]:
        return await self._fetch("cancel_many", [_id(i) for i in ids], reason, actor, compensate)

    async def command_of(self, instance_id: str, command_id: int) -> dict[str, Any] | None:
        rows = await self._fetch("command_of", _id(instance_id), command_id)
        return rows[0] if rows else None

    async def replay(
        self, instance_id: str, step: str, state: Any, baseline: Any, expected_seq: int, from_seq: int,
        actor: str | None, cause: Any = None,
    ) -> dict[str, Any]:
        key = _id(instance_id)
        with translate_errors(self.url):
            async with self.pool.acquire() as conn, conn.transaction():
                found = await conn.fetchrow(self.q["replay"], key, step, state, baseline, expected_seq, from_seq, actor)
                assert found is not None  # replay_instance answers one row
                row = _row(found)
                if cause is not None and row["outcome"] == "replayed":
                    await conn.execute(self.q["replay_cause"], key, row["visit"], cause)
                if row["outcome"] == "child_live":  # the children that refused it, as its locks left them
                    row["children"] = [_row(r) for r in await conn.fetch(self.q["live_awaited_children"], key)]
        return row

    async def role_privileges(self) -> dict[str, Any]:
        rows = await self._fetch("role_privileges", self.schema)
        return rows[0] if rows else {}

    async def grants(self, role: str, *, read_only: bool) -> list[str]:
        with translate_errors(self.url):
            async with self.pool.acquire() as conn:
                version = await server_version_num(conn, self.schema)
        return grant_statements(self.schema, role, read_only=read_only, maintain=version >= MAINTAIN_SINCE)

    async def apply_grants(self, statements: list[str]) -> None:
        with translate_errors(self.url):
            async with self.pool.acquire() as conn, conn.transaction():
                for statement in statements:
                    try:
                        await conn.execute(statement)
                    except asyncpg.exceptions.UndefinedObjectError as exc:  # the role to grant to
                        raise InvalidInput(f"{exc}: create it first (CREATE ROLE ... LOGIN), then grant",
                                           what="role") from None

    async def db_now(self) -> datetime:
        return await self.store.db_now()


MAINTAIN_SINCE = 170_000
"""The server_version_num of the first PostgreSQL with the MAINTAIN privilege (17)."""


def grant_statements(schema: str, role: str, *, read_only: bool = False, maintain: bool = False) -> list[str]:
    """The GRANT statements of the runtime (or read-only) role, identifiers quoted; with `maintain` (a
    server that has the privilege), the runtime role's MAINTAIN on the hot tables too."""
    text = render(read_text("sql", "grants.sql"), schema).replace("{{role}}", quote_name(role, "role"))

    def block(name: str) -> list[str]:
        body = text.split(f"-- name: {name}\n", 1)[1].split("-- name:", 1)[0]
        return [line.strip() for line in body.splitlines() if line.strip() and not line.lstrip().startswith("--")]

    if read_only:
        return block("read_only")
    return block("runtime") + (block("maintain") if maintain else [])
