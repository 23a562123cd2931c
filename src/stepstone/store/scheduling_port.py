"""The store port of schedules and flow limits (`stepstone.scheduling`), beside `store/port.py`.

The scheduler in the runtime and the client's schedule and limit operations are typed against
`SchedulingStore`; `PostgresStore` implements it (`store/scheduling.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from stepstone.core.pin import DEFAULT_SCOPE

__all__ = ["FiredTick", "SchedulingStore"]

FiredTick = tuple[str, str | None, datetime | None]
"""One tick of a firing: (outcome, instance id, tick); see `fire_schedule` in the migration."""


@runtime_checkable
class SchedulingStore(Protocol):
    async def db_now(self) -> datetime: ...
    async def put_schedule(
        self, name: str, definition_id: str, spec: dict[str, Any], input: Any, next_fire_at: datetime,  # noqa: A002
        scope: str = DEFAULT_SCOPE,
    ) -> tuple[bool, datetime]: ...
    async def list_schedules(self, name: str | None = None) -> list[dict[str, Any]]: ...
    async def pause_schedule(self, name: str) -> bool: ...
    async def resume_schedule(self, name: str, next_fire_at: datetime) -> bool: ...
    async def delete_schedule(self, name: str) -> bool: ...
    async def due_schedules(
        self, limit: int, definitions: list[str], held: Sequence[str] = (),
    ) -> list[dict[str, Any]]: ...
    async def next_schedule(self, definitions: list[str], held: Sequence[str] = ()) -> float | None: ...
    async def fire_schedule(
        self, name: str, expected: datetime, following: datetime, ticks: list[tuple[datetime, str]],
        version: int, plan_hash: str, step: str, state: Any,
        deadline_seconds: float | None = None, start_deadline_seconds: float | None = None,
    ) -> list[FiredTick]: ...
    async def put_flow_limit(
        self, scope: str, definition_id: str, key_field: str | None, max_running: int | None,
        min_interval: float | None,
    ) -> int: ...
    async def delete_flow_limit(self, scope: str, definition_id: str) -> tuple[bool, int]: ...
    async def flow_limits(
        self, scope: str | None = None, definition_id: str | None = None,
    ) -> list[dict[str, Any]]: ...
