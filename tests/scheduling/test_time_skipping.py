"""Time skipping: `engine.advance(days=3)` stops at every timer and schedule tick due on the way."""

from __future__ import annotations

from datetime import timedelta

import asyncpg

from stepstone.scheduling import Schedule
from stepstone.testing import Engine
from tests.scheduling.workflows import daily, report


async def test_a_daily_timer_fires_once_per_day_skipped(engine: Engine) -> None:
    iid = await engine.client.start(daily, {})
    before = await engine.store.db_now()
    after = await engine.advance(days=3)
    assert after - before >= timedelta(days=3)
    info = await engine.client.get(iid)
    assert (info.status, info.state["data"]["reminders"]) == ("COMPLETED", 3)
    runs = await engine.assert_step_ran(iid, "remind", times=3)
    assert runs.attempts == [1, 1, 1]


async def test_advance_with_a_timedelta_only_moves_the_clock(engine: Engine) -> None:
    iid = await engine.client.start(daily, {})
    await engine.run_until_idle()
    await engine.advance(timedelta(days=3))
    assert (await engine.client.get(iid)).state["data"]["reminders"] == 1
    await engine.run_until_idle()  # one timer fires; the next is a day after the moved clock
    assert (await engine.client.get(iid)).state["data"]["reminders"] == 2


async def test_skipping_fires_every_schedule_tick_on_the_way(engine: Engine, db: asyncpg.Connection) -> None:
    await engine.client.schedule(Schedule("hourly", report, cron="0 * * * *", catch_up="none"))
    await engine.advance(hours=5)
    count = await db.fetchval("SELECT count(*) FROM stepstone.instances WHERE status = 'COMPLETED'")
    assert count == 5  # each tick fired on time, though catch_up="none" would drop a late one
