"""The PostgreSQL adapter of the management port (`store/management_port.py`), on the engine store's pool.

Every statement is a named query from `sql/management.sql`. History and command rows come back as the
API and the UI show them: redacted by the instance's registration (`Redaction.shown_history`,
`shown_command`; docs/operations.md, Redaction). Ids that are not UUIDs match nothing
(the caller says NotFound), so no malformed id reaches the database as an error.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any, TypeVar

import asyncpg

from stepstone.core.model import FAILURE_KINDS, STATUSES
from stepstone.core.redaction import Redaction
from stepstone.store.database import translate_errors
from stepstone.store.management_port import TokenRecord
from stepstone.store.postgres import PostgresStore
from stepstone.store.queries import named_queries

T = TypeVar("T")

__all__ = ["PostgresManagement", "open_management"]


def open_management(store: object) -> PostgresManagement:
    """The management queries on the pool and schema of a store `open_store` built."""
    if not isinstance(store, PostgresStore):
        raise TypeError(f"the management API needs the PostgreSQL store, not {type(store).__name__}")
    return PostgresManagement(store)


def _keys(instance_ids: Sequence[str]) -> dict[str, uuid.UUID]:
    """Each id as given, with the UUID it spells (ids that spell none left out)."""
    return {i: k for i in set(instance_ids) if (k := _uuid(i)) is not None}


def _as_given(keys: dict[str, uuid.UUID], found: dict[uuid.UUID, T]) -> dict[str, T]:
    """What was found, keyed by the ids as the caller gave them: any spelling of a UUID finds an instance
    (upper case, no hyphens), so a lookup keyed the database's way missed it (and a redaction looked up so
    was none: the state shown whole)."""
    return {given: found[key] for given, key in keys.items() if key in found}


def _uuid(value: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None


def _row(record: asyncpg.Record) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, uuid.UUID) else v) for k, v in record.items()}


def management_queries(schema: str) -> dict[str, str]:
    """The named queries of management.sql, with `instance_counts` built of one `instance_count` branch per
    status: the branch is written once, and a status added to the model is counted without an edit here."""
    q = named_queries("management.sql", schema)
    counts = "\nUNION ALL\n".join(q["instance_count"].replace("/*status*/", status) for status in STATUSES)
    return {**q, "instance_counts": counts}


def _token(record: asyncpg.Record) -> TokenRecord:
    return TokenRecord(str(record["id"]), record["name"], record["role"], record["scope"],
                       record.get("created_at"), record.get("created_by"), record.get("revoked_at"),
                       tuple(record.get("groups") or ()))


class PostgresManagement:
    def __init__(self, store: PostgresStore) -> None:
        self.pool = store.pool
        self.url = store.url
        self.q = management_queries(store.schema)

    async def _fetch(self, name: str, *args: Any) -> list[asyncpg.Record]:
        with translate_errors(self.url):
            return await self.pool.fetch(self.q[name], *args)

    async def _rows(self, name: str, *args: Any) -> list[dict[str, Any]]:
        return [_row(r) for r in await self._fetch(name, *args)]

    async def instance_scope(self, instance_id: str) -> str | None:
        key = _uuid(instance_id)
        if key is None:
            return None
        rows = await self._fetch("instance_scope", key)
        return str(rows[0]["scope"]) if rows else None

    async def instance_scopes(self, instance_ids: Sequence[str]) -> dict[str, str]:
        keys = _keys(instance_ids)
        rows = await self._fetch("instance_scopes", list(set(keys.values()))) if keys else []
        return _as_given(keys, {r["id"]: str(r["scope"]) for r in rows})

    async def redactions(self, instance_ids: Sequence[str]) -> dict[str, Redaction]:
        keys = _keys(instance_ids)
        rows = await self._fetch("instance_redactions", list(set(keys.values()))) if keys else []
        return _as_given(keys, {r["id"]: Redaction.of_document(r["sensitive"], r["sensitive_payloads"])
                                for r in rows})

    async def shown_tasks(self, tasks: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Tasks (`TaskInfo` fields) as every view shows them, the API's, the UI's and the CLI's: the state
        fields each shows and its completion's payload redacted by its instance's registration."""
        redactions = await self.redactions([str(t["instance_id"]) for t in tasks]) if tasks else {}
        return [task if (redaction := redactions.get(str(task["instance_id"]))) is None
                else redaction.shown_task(task) for task in tasks]

    async def _redaction(self, instance_id: str) -> Redaction:
        return (await self.redactions([instance_id])).get(instance_id, Redaction())

    async def instance_stamp(self, instance_id: str) -> tuple[str, datetime] | None:
        key = _uuid(instance_id)
        rows = [] if key is None else await self._fetch("instance_stamp", key)
        return (str(rows[0]["status"]), rows[0]["updated_at"]) if rows else None

    async def instances_page(
        self, scopes: Sequence[str] | None, *, statuses: Sequence[str] = (), definition: str | None,
        business_key: str | None, after: tuple[datetime, str] | None, limit: int, include_archived: bool = False,
    ) -> list[dict[str, Any]]:
        """Newest first, at most `limit` rows after `after`; of any of `statuses` (none given: every one).
        Several statuses are read one at a time, each on its own plan as a single status is, and merged:
        the first `limit` rows of them all are among the first `limit` of each."""
        at, after_id = after if after else (None, None)
        wanted: list[str | None] = [*sorted(set(statuses))] or [None]
        pages = [await self._rows("instances_page", _scopes(scopes), status, definition, business_key, at,
                                  _uuid(after_id) if after_id else None, limit, include_archived)
                 for status in wanted]
        if len(pages) == 1:
            return pages[0]
        merged = sorted((r for p in pages for r in p), key=lambda r: (r["created_at"], r["id"]), reverse=True)
        return merged[:limit]

    async def instance_counts(self, scopes: Sequence[str] | None, definition: str | None, cap: int,
                              include_archived: bool = False, *, business_key: str | None = None) -> dict[str, int]:
        rows = await self._fetch("instance_counts", _scopes(scopes), definition, cap, include_archived,
                                 business_key)
        return {r["status"]: int(r["n"]) for r in rows if r["n"]}

    async def history_page(
        self, instance_id: str, *, after: int, limit: int, failed_only: bool
    ) -> list[dict[str, Any]]:
        key = _uuid(instance_id)
        kinds = sorted(FAILURE_KINDS) if failed_only else None
        if key is None:
            return []
        redaction = await self._redaction(instance_id)
        return [redaction.shown_history(r) for r in await self._rows("history_page", key, after, limit, kinds)]

    async def commands_page(
        self, instance_id: str, *, after: int, limit: int, states: Sequence[str] | None
    ) -> list[dict[str, Any]]:
        key = _uuid(instance_id)
        if key is None:
            return []
        redaction = await self._redaction(instance_id)
        return [redaction.shown_command(r) for r in
                await self._rows("commands_page", key, after, limit, None if states is None else list(states))]

    async def dead_commands_page(
        self, scopes: Sequence[str] | None, *, before: int | None, limit: int, definition: str | None = None
    ) -> list[dict[str, Any]]:
        return await self._rows("dead_commands_page", _scopes(scopes), before, limit, definition)

    async def instance_outbox(self, instance_id: str, *, after: int, limit: int) -> list[dict[str, Any]]:
        key = _uuid(instance_id)
        return [] if key is None else await self._rows("instance_outbox", key, after, limit)

    async def definitions_page(
        self, scopes: Sequence[str] | None, *, after: tuple[str, str, int] | None, limit: int
    ) -> list[dict[str, Any]]:
        scope, definition, version = after if after else (None, None, None)
        return await self._rows("definitions_page", _scopes(scopes), scope, definition, version, limit)

    async def definition_plan(self, scope: str, definition_id: str, version: int) -> dict[str, Any] | None:
        rows = await self._rows("definition_plan", scope, definition_id, version)
        return rows[0] if rows else None

    # -- API tokens ---------------------------------------------------------------------------

    async def create_token(
        self, token_id: uuid.UUID, name: str, token_hash: str, role: str, scope: str, created_by: str | None,
        groups: tuple[str, ...] = (),
    ) -> TokenRecord:
        rows = await self._fetch("token_insert", token_id, name, token_hash, role, scope, created_by, list(groups))
        return _token(rows[0])

    async def list_tokens(self, *, include_revoked: bool) -> list[TokenRecord]:
        return [_token(r) for r in await self._fetch("token_list", include_revoked)]

    async def revoke_token(self, token_id: str) -> TokenRecord | None:
        key = _uuid(token_id)
        rows = [] if key is None else await self._fetch("token_revoke", key)
        return _token(rows[0]) if rows else None

    async def token_by_hash(self, token_hash: str) -> TokenRecord | None:
        rows = await self._fetch("token_by_hash", token_hash)
        return _token(rows[0]) if rows else None

    async def active_token_count(self) -> int:
        rows = await self._fetch("token_active_count")
        return int(rows[0][0])


def _scopes(scopes: Sequence[str] | None) -> list[str] | None:
    return None if scopes is None else list(scopes)
