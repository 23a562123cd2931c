"""Schedule and flow-limit operations shared by `Client` and the CLI (`stepstone schedules`, `limits`).

Each takes the store and what the caller already resolved (the workflow's id, its JSON input), so
the client keeps its own checks and the store stays the only place that speaks SQL.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from stepstone.core.limits import MAX_INT4
from stepstone.core.pin import DEFAULT_SCOPE
from stepstone.core.timestamps import MAX_SECONDS
from stepstone.errors import InvalidInput, NotFound
from stepstone.scheduling.schedule import Schedule, ScheduleError, ScheduleSpec
from stepstone.store.scheduling_port import SchedulingStore

__all__ = [
    "FlowLimitInfo",
    "FlowLimits",
    "ScheduleInfo",
    "ScheduleNotFound",
    "Schedules",
    "delete_schedule",
    "flow_limits",
    "list_schedules",
    "pause_schedule",
    "put_flow_limit",
    "put_schedule",
    "resume_schedule",
]


class ScheduleNotFound(NotFound):
    """No schedule has that name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no schedule named {name!r}")
        self.name = name


@dataclass(frozen=True)
class ScheduleInfo:
    """A stored schedule: when it fires next, what it last started, how often it fired and skipped."""

    name: str
    workflow: str
    spec: dict[str, Any]
    input: Any
    paused: bool
    next_fire_at: datetime
    last_tick: datetime | None
    last_instance: str | None
    fired: int
    skipped: int
    scope: str = DEFAULT_SCOPE
    """The scope its instances start in."""

    @classmethod
    def of(cls, row: dict[str, Any]) -> ScheduleInfo:
        return cls(row["name"], row["definition_id"], row["spec"], row["input"], row["paused"], row["next_fire_at"],
                   row["last_tick"], row["last_instance"], int(row["fired"]), int(row["skipped"]), row["scope"])


@dataclass(frozen=True)
class FlowLimitInfo:
    """A workflow's flow limit in one scope and how many of that scope's instances of it run and wait now."""

    workflow: str
    key: str | None
    max_running: int | None
    min_interval: float | None
    running: int
    waiting: int
    scope: str = "default"


Schedules = list[ScheduleInfo]
FlowLimits = list[FlowLimitInfo]


def spec_of(schedule: Schedule) -> ScheduleSpec:
    try:
        return schedule.spec()
    except ScheduleError as exc:
        raise InvalidInput(f"schedule {schedule.name!r}: {exc}", what="schedule") from None


async def put_schedule(store: SchedulingStore, schedule: Schedule, state: Any) -> ScheduleInfo:
    """Store the schedule (its next tick from the database clock); an unchanged one keeps its next tick."""
    spec = spec_of(schedule)
    now = await store.db_now()
    await store.put_schedule(schedule.name, schedule.workflow_id, spec.document(), state, spec.next_after(now),
                             schedule.scope)
    return (await list_schedules(store, schedule.name))[0]


async def list_schedules(store: SchedulingStore, name: str | None = None) -> list[ScheduleInfo]:
    rows = await store.list_schedules(name)
    if name is not None and not rows:
        raise ScheduleNotFound(name)
    return [ScheduleInfo.of(r) for r in rows]


async def pause_schedule(store: SchedulingStore, name: str) -> None:
    if not await store.pause_schedule(name):
        raise ScheduleNotFound(name)


async def resume_schedule(store: SchedulingStore, name: str) -> ScheduleInfo:
    """Resume a paused schedule from its next tick after now (ticks missed while paused do not fire)."""
    info = (await list_schedules(store, name))[0]
    if info.paused:
        spec = ScheduleSpec.from_document(info.spec)
        await store.resume_schedule(name, spec.next_after(await store.db_now()))
    return (await list_schedules(store, name))[0]


async def delete_schedule(store: SchedulingStore, name: str) -> None:
    if not await store.delete_schedule(name):
        raise ScheduleNotFound(name)


async def put_flow_limit(
    store: SchedulingStore, workflow: str, *, max_running: int | None, key: str | None, min_interval: float | None,
    scope: str = "default",
) -> int:
    if max_running is None and min_interval is None:
        raise InvalidInput("a flow limit takes max_running=..., min_interval=... or both", what="flow limit")
    if max_running is not None and not 1 <= max_running <= MAX_INT4:
        raise InvalidInput(f"max_running must be from 1 to {MAX_INT4}, got {max_running}", what="flow limit")
    if min_interval is not None and not 0 < min_interval <= MAX_SECONDS:  # a start after it is still an instant
        raise InvalidInput(f"min_interval must be positive and at most a thousand years, got {min_interval}",
                           what="flow limit")
    field = None if key is None else key.removeprefix("state.")
    if field is not None and not field:
        raise InvalidInput("key names 'business_key' or a top-level state field", what="flow limit")
    return await store.put_flow_limit(scope, workflow, field, max_running, min_interval)


async def flow_limits(
    store: SchedulingStore, workflow: str | None = None, scope: str | None = None,
) -> list[FlowLimitInfo]:
    return [FlowLimitInfo(r["definition_id"], r["key_field"], r["max_running"], r["min_interval_seconds"],
                          int(r["running"]), int(r["waiting"]), r["scope"])
            for r in await store.flow_limits(scope, workflow)]
