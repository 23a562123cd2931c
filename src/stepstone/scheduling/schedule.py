"""Schedules: a workflow started on a cron expression or a fixed interval, stored as a row.

    Schedule("hourly-report", report, cron="0 * * * *", input={"kind": "hourly"}, timezone="Europe/Paris")
    Schedule("poll", poller, every=timedelta(minutes=5), overlap="allow", catch_up="all")

Any worker fires a due schedule; the row, locked with SKIP LOCKED and advanced in the same statement
that starts the instance, makes it exactly one start per tick across every worker and restart (the
tick is also the start's idempotency key). This module is pure: the ticks a firing starts are
computed here (`due_ticks`), the store only carries them out.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from stepstone.core.pin import DEFAULT_SCOPE
from stepstone.core.timestamps import MAX_SECONDS
from stepstone.scheduling.cron import Cron, CronError

__all__ = ["CATCH_UPS", "OVERLAPS", "Schedule", "ScheduleError", "ScheduleSpec", "due_ticks", "tick_instance_id"]

Overlap = Literal["skip", "allow", "cancel_previous"]
CatchUp = Literal["none", "one", "all"]
OVERLAPS: tuple[str, ...] = ("skip", "allow", "cancel_previous")
CATCH_UPS: tuple[str, ...] = ("none", "one", "all")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MAX_TICKS = 100  # per firing: catch_up="all" after a long downtime continues on the next pass


class ScheduleError(ValueError):
    """A schedule that cannot be stored as given."""


@dataclass(frozen=True)
class ScheduleSpec:
    """When a schedule fires and what it does about overlaps and missed ticks: the stored `spec`."""

    cron: str | None = None
    every_seconds: float | None = None
    timezone: str = "UTC"
    overlap: str = "skip"
    catch_up: str = "one"
    grace_seconds: float = 60.0

    def __post_init__(self) -> None:
        if (self.cron is None) == (self.every_seconds is None):
            raise ScheduleError("a schedule takes exactly one of cron=... and every=...")
        if self.cron is not None:
            try:
                Cron.parse(self.cron)
            except CronError as exc:
                raise ScheduleError(str(exc)) from None
        if self.every_seconds is not None and not 1 <= self.every_seconds <= MAX_SECONDS:
            raise ScheduleError(f"every= must be from one second to a thousand years, got {self.every_seconds} s")
        if self.overlap not in OVERLAPS:
            raise ScheduleError(f"overlap must be one of {', '.join(OVERLAPS)}, got {self.overlap!r}")
        if self.catch_up not in CATCH_UPS:
            raise ScheduleError(f"catch_up must be one of {', '.join(CATCH_UPS)}, got {self.catch_up!r}")
        if not 0 <= self.grace_seconds <= MAX_SECONDS:
            raise ScheduleError(f"grace must be from 0 to a thousand years, got {self.grace_seconds} s")
        self.zone()  # an unknown time zone is refused when the schedule is made

    def zone(self) -> ZoneInfo:
        try:
            return ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ScheduleError(f"unknown time zone {self.timezone!r}") from None

    def next_after(self, moment: datetime) -> datetime:
        """The first tick strictly after `moment`."""
        if self.every_seconds is not None:
            step = round(self.every_seconds * 1_000_000)
            elapsed = (moment - _EPOCH) // timedelta(microseconds=1)
            return _EPOCH + timedelta(microseconds=(elapsed // step + 1) * step)
        assert self.cron is not None
        return Cron.parse(self.cron).next_after(moment, self.zone())

    def latest_at_or_before(self, first: datetime, now: datetime) -> tuple[datetime, datetime]:
        """The last tick in [first, now] (first itself being a tick <= now) and the tick after it."""
        if self.every_seconds is not None:
            step = round(self.every_seconds * 1_000_000)
            elapsed = (now - _EPOCH) // timedelta(microseconds=1)
            last = max(first, _EPOCH + timedelta(microseconds=elapsed // step * step))
            return last, self.next_after(last)
        last, following = first, self.next_after(first)
        while following <= now:
            last, following = following, self.next_after(following)
        return last, following

    def document(self) -> dict[str, Any]:
        return {"cron": self.cron, "every_seconds": self.every_seconds, "timezone": self.timezone,
                "overlap": self.overlap, "catch_up": self.catch_up, "grace_seconds": self.grace_seconds}

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> ScheduleSpec:
        return cls(doc.get("cron"), doc.get("every_seconds"), doc.get("timezone", "UTC"), doc.get("overlap", "skip"),
                   doc.get("catch_up", "one"), float(doc.get("grace_seconds", 60.0)))


@dataclass(frozen=True)
class Schedule:
    """A named schedule of `workflow` (a Workflow or its id). Exactly one of `cron` and `every`. Its instances
    start in `scope` (tenant), each on the version a start of the workflow selects there."""

    name: str
    workflow: Any
    cron: str | None = None
    every: timedelta | float | None = None
    input: Any = None
    timezone: str = "UTC"
    overlap: Overlap = "skip"
    catch_up: CatchUp = "one"
    grace: timedelta | float = 60.0
    scope: str = DEFAULT_SCOPE

    @property
    def workflow_id(self) -> str:
        return self.workflow if isinstance(self.workflow, str) else str(self.workflow.id)

    def spec(self) -> ScheduleSpec:
        for what, value in (("every", self.every), ("grace", self.grace)):
            if isinstance(value, str | bool):  # float("5") read "5" as seconds, "5m" as an error of float's
                raise ScheduleError(f"schedule {self.name!r}: {what} takes a timedelta or a number of seconds, "
                                    f"got {value!r}")
        every = self.every.total_seconds() if isinstance(self.every, timedelta) else self.every
        grace = self.grace.total_seconds() if isinstance(self.grace, timedelta) else float(self.grace)
        return ScheduleSpec(self.cron, None if every is None else float(every), self.timezone, self.overlap,
                            self.catch_up, grace)


def due_ticks(spec: ScheduleSpec, first_due: datetime, now: datetime) -> tuple[list[datetime], datetime]:
    """What a firing at `now` starts, given the schedule's first due tick (<= now), and its next tick.

    catch_up="all": every missed tick, oldest first (at most 100 a firing; the rest on the next one);
    "one": the latest due tick only; "none": the latest due tick when it is at most `grace` late."""
    if spec.catch_up == "all":
        ticks: list[datetime] = []
        tick = first_due
        while tick <= now and len(ticks) < _MAX_TICKS:
            ticks.append(tick)
            tick = spec.next_after(tick)
        return ticks, tick
    last, following = spec.latest_at_or_before(first_due, now)
    if spec.catch_up == "none" and (now - last).total_seconds() > spec.grace_seconds:
        return [], following
    return [last], following


def tick_instance_id(schedule: str, tick: datetime) -> str:
    """The instance id of a schedule's tick: the same on every worker that computes it."""
    moment = tick.astimezone(UTC).isoformat()
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"stepstone:schedule:{schedule}:{moment}"))
