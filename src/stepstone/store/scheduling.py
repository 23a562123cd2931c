"""The PostgreSQL side of schedules and flow limits: named queries of `sql/schedules.sql`.

Mixed into `PostgresStore`; every statement is one round trip, and firing a schedule is one
statement (`fire_schedule` in migration 0011) that locks the row with SKIP LOCKED, starts the
ticks' instances and advances the row.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg

from stepstone.core.pin import DEFAULT_SCOPE
from stepstone.store.database import translate_errors
from stepstone.store.queries import named_queries
from stepstone.store.scheduling_port import FiredTick

__all__ = ["SchedulingQueries"]


class SchedulingQueries:
    """Schedule and flow-limit statements on the store's pool (see `SchedulingStore`)."""

    pool: asyncpg.Pool
    url: str
    schema: str

    def _sq(self, name: str) -> str:
        return named_queries("schedules.sql", self.schema)[name]

    async def _sfetch(self, name: str, *args: Any) -> list[asyncpg.Record]:
        with translate_errors(self.url):
            return await self.pool.fetch(self._sq(name), *args)

    async def put_schedule(
        self, name: str, definition_id: str, spec: dict[str, Any], input: Any, next_fire_at: datetime,  # noqa: A002
        scope: str = DEFAULT_SCOPE,
    ) -> tuple[bool, datetime]:
        row = (await self._sfetch("put_schedule", name, definition_id, spec, input, next_fire_at, scope))[0]
        return bool(row["created"]), row["next_fire_at"]

    async def list_schedules(self, name: str | None = None) -> list[dict[str, Any]]:
        rows = await (self._sfetch("list_schedules") if name is None else self._sfetch("schedule_row", name))
        return [{**dict(r), "last_instance": None if r["last_instance"] is None else str(r["last_instance"])}
                for r in rows]

    async def pause_schedule(self, name: str) -> bool:
        return bool(await self._sfetch("pause_schedule", name))

    async def resume_schedule(self, name: str, next_fire_at: datetime) -> bool:
        return bool(await self._sfetch("resume_schedule", name, next_fire_at))

    async def delete_schedule(self, name: str) -> bool:
        return bool(await self._sfetch("delete_schedule", name))

    async def due_schedules(
        self, limit: int, definitions: list[str], held: Sequence[str] = (),
    ) -> list[dict[str, Any]]:
        return [dict(r) for r in await self._sfetch("due_schedules", limit, definitions, list(held))]

    async def next_schedule(self, definitions: list[str], held: Sequence[str] = ()) -> float | None:
        rows = await self._sfetch("next_schedule", definitions, list(held))
        value = rows[0][0] if rows else None
        return None if value is None else float(value)

    async def fire_schedule(
        self, name: str, expected: datetime, following: datetime, ticks: list[tuple[datetime, str]],
        version: int, plan_hash: str, step: str, state: Any,
        deadline_seconds: float | None = None, start_deadline_seconds: float | None = None,
    ) -> list[FiredTick]:
        doc = [{"tick": tick.isoformat(), "id": iid} for tick, iid in ticks]
        rows = await self._sfetch("fire_schedule", name, expected, following, doc, version, plan_hash, step, state,
                                  deadline_seconds, start_deadline_seconds)
        return [(r["outcome"], None if r["instance_id"] is None else str(r["instance_id"]), r["tick"]) for r in rows]

    async def put_flow_limit(
        self, scope: str, definition_id: str, key_field: str | None, max_running: int | None,
        min_interval: float | None,
    ) -> int:
        """Set the scope's limit and admit what it lets through now; returns how many held instances it admitted."""
        admitted = 0
        with translate_errors(self.url):
            async with self.pool.acquire() as conn, conn.transaction():
                await conn.execute(self._sq("put_flow_limit"), scope, definition_id, key_field, max_running,
                                   min_interval)
                for bucket in await conn.fetch(self._sq("flow_buckets"), scope, definition_id):
                    admitted += int(await conn.fetchval(self._sq("flow_admit"), scope, definition_id,
                                                        bucket["key_value"]))
        return admitted

    async def delete_flow_limit(self, scope: str, definition_id: str) -> tuple[bool, int]:
        row = (await self._sfetch("delete_flow_limit", scope, definition_id))[0]
        return bool(row["removed"]), int(row["released"])

    async def flow_limits(self, scope: str | None = None, definition_id: str | None = None) -> list[dict[str, Any]]:
        return [dict(r) for r in await self._sfetch("flow_limits", scope, definition_id)]

