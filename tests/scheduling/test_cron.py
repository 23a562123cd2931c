"""Cron expressions and schedule ticks: pure, no database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from stepstone.scheduling.cron import Cron, CronError
from stepstone.scheduling.schedule import Schedule, ScheduleError, ScheduleSpec, due_ticks, tick_instance_id

T0 = datetime(2026, 3, 2, 10, 7, 30, tzinfo=UTC)  # a Monday


def nxt(expr: str, at: datetime = T0, zone: str = "UTC") -> datetime:
    return Cron.parse(expr).next_after(at, ZoneInfo(zone))


def test_fields_ranges_steps_lists_and_names() -> None:
    assert nxt("* * * * *") == datetime(2026, 3, 2, 10, 8, tzinfo=UTC)
    assert nxt("*/15 * * * *") == datetime(2026, 3, 2, 10, 15, tzinfo=UTC)
    assert nxt("0 * * * *") == datetime(2026, 3, 2, 11, 0, tzinfo=UTC)
    assert nxt("30 9-17/4 * * *") == datetime(2026, 3, 2, 13, 30, tzinfo=UTC)
    assert nxt("0 0 * * sat,sun") == datetime(2026, 3, 7, tzinfo=UTC)
    assert nxt("0 0 1 jan *") == datetime(2027, 1, 1, tzinfo=UTC)
    assert nxt("@hourly") == nxt("0 * * * *")
    assert nxt("0 0 * * 7") == nxt("0 0 * * 0") == datetime(2026, 3, 8, tzinfo=UTC)
    assert nxt("0 0 29 2 *") == datetime(2028, 2, 29, tzinfo=UTC)


def test_both_day_fields_restricted_match_either() -> None:
    # classic cron: day 15 OR a Friday, whichever comes first
    assert nxt("0 0 15 * fri") == datetime(2026, 3, 6, tzinfo=UTC)


def test_strictly_after_a_tick() -> None:
    tick = datetime(2026, 3, 2, 11, 0, tzinfo=UTC)
    assert nxt("0 * * * *", tick) == tick + timedelta(hours=1)


def test_time_zone_and_dst() -> None:
    paris = "Europe/Paris"
    # 09:00 in Paris is 08:00 UTC in winter
    assert nxt("0 9 * * *", T0, paris) == datetime(2026, 3, 3, 8, 0, tzinfo=UTC)
    # 29 March 2026: 02:00-03:00 does not exist in Paris; that day's 02:30 does not fire
    before_gap = datetime(2026, 3, 28, 12, 0, tzinfo=UTC)
    assert nxt("30 2 * * *", before_gap, paris) == datetime(2026, 3, 30, 0, 30, tzinfo=UTC)
    # 25 October 2026: 02:30 happens twice; it fires once, at the first
    before_fold = datetime(2026, 10, 24, 12, 0, tzinfo=UTC)
    first = nxt("30 2 * * *", before_fold, paris)
    assert first == datetime(2026, 10, 25, 0, 30, tzinfo=UTC)
    assert nxt("30 2 * * *", first, paris) == datetime(2026, 10, 26, 1, 30, tzinfo=UTC)


@pytest.mark.parametrize("expr", ["", "* * * *", "60 * * * *", "* 24 * * *", "*/0 * * * *", "a * * * *",
                                  "5-1 * * * *", "0 0 31 2 *"])
def test_bad_expressions_are_refused(expr: str) -> None:
    with pytest.raises(CronError):
        Cron.parse(expr).next_after(T0)


def test_schedule_spec_validation() -> None:
    with pytest.raises(ScheduleError, match="exactly one"):
        Schedule("s", "report").spec()
    with pytest.raises(ScheduleError, match="exactly one"):
        Schedule("s", "report", cron="* * * * *", every=60).spec()
    with pytest.raises(ScheduleError, match="overlap"):
        Schedule("s", "report", every=60, overlap="sometimes").spec()  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="time zone"):
        Schedule("s", "report", cron="* * * * *", timezone="Mars/Olympus").spec()
    with pytest.raises(ScheduleError, match="from one second to a thousand years"):
        Schedule("s", "report", every=0.5).spec()
    # Past a thousand years the next tick is no instant (an OverflowError where the schedule fired).
    for every in (float("inf"), float("nan"), 1e300):
        with pytest.raises(ScheduleError, match="from one second to a thousand years"):
            Schedule("s", "report", every=every).spec()
    grace = Schedule("s", "report", every=60, grace=float("inf"))
    with pytest.raises(ScheduleError, match="grace must be from 0 to a thousand years"):
        grace.spec()


def test_every_is_anchored_to_the_epoch() -> None:
    spec = Schedule("s", "report", every=timedelta(minutes=5)).spec()
    assert spec.next_after(T0) == datetime(2026, 3, 2, 10, 10, tzinfo=UTC)
    assert spec.next_after(datetime(2026, 3, 2, 10, 10, tzinfo=UTC)) == datetime(2026, 3, 2, 10, 15, tzinfo=UTC)


def _spec(catch_up: str, **kw: object) -> ScheduleSpec:
    return ScheduleSpec(cron="0 * * * *", catch_up=catch_up, **kw)  # type: ignore[arg-type]


def test_catch_up_policies() -> None:
    first = datetime(2026, 3, 2, 8, 0, tzinfo=UTC)
    now = datetime(2026, 3, 2, 10, 30, tzinfo=UTC)
    ticks, following = due_ticks(_spec("all"), first, now)
    assert ticks == [first, first + timedelta(hours=1), first + timedelta(hours=2)]
    assert following == datetime(2026, 3, 2, 11, 0, tzinfo=UTC)
    assert due_ticks(_spec("one"), first, now) == ([first + timedelta(hours=2)], following)
    assert due_ticks(_spec("none"), first, now) == ([], following)  # the latest tick is 30 min late
    on_time = datetime(2026, 3, 2, 10, 0, 20, tzinfo=UTC)
    assert due_ticks(_spec("none"), first, on_time) == ([first + timedelta(hours=2)], following)


def test_catch_up_all_is_bounded_per_firing() -> None:
    spec = ScheduleSpec(every_seconds=60, catch_up="all")
    first = datetime(2026, 3, 2, 0, 0, tzinfo=UTC)
    ticks, following = due_ticks(spec, first, first + timedelta(days=1))
    assert len(ticks) == 100
    assert following == first + timedelta(minutes=100)


def test_every_catch_up_one_over_a_long_downtime_is_arithmetic() -> None:
    spec = ScheduleSpec(every_seconds=1, catch_up="one")
    first = datetime(2026, 3, 2, 0, 0, tzinfo=UTC)
    now = first + timedelta(days=365, microseconds=500_000)
    assert due_ticks(spec, first, now) == ([first + timedelta(days=365)], first + timedelta(days=365, seconds=1))


def test_tick_ids_are_stable() -> None:
    tick = datetime(2026, 3, 2, 11, 0, tzinfo=UTC)
    assert tick_instance_id("s", tick) == tick_instance_id("s", tick.astimezone(ZoneInfo("Asia/Tokyo")))
    assert tick_instance_id("s", tick) != tick_instance_id("t", tick)


def test_an_expression_that_never_fires_is_refused_when_parsed() -> None:
    with pytest.raises(CronError, match="never fires"):
        Cron.parse("0 0 30 2 *")
    with pytest.raises(ScheduleError, match="never fires"):
        ScheduleSpec(cron="0 0 31 4,6 *")
    assert Cron.parse("0 0 29 2 *").next_after(datetime(2026, 1, 1, tzinfo=UTC)) == datetime(2028, 2, 29, tzinfo=UTC)
