"""Time skipping: `engine.advance(days=3)` stops at every timer, reminder, deadline and schedule tick due on
the way."""

from __future__ import annotations

import math
from datetime import timedelta

import asyncpg
import pytest

from stepstone import testing
from stepstone.errors import InvalidInput
from stepstone.scheduling import Schedule
from stepstone.testing import Engine, open_engine
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


@pytest.mark.parametrize("by", [3 * 86_400, 3 * 86_400.0, timedelta(days=3)])
async def test_advance_by_a_number_of_seconds_or_a_timedelta_is_the_same_skip(engine: Engine, by: object) -> None:
    """`advance(3)` only moved the clock while `advance(seconds=3)` also ran what came due."""
    iid = await engine.client.start(daily, {})
    await engine.advance(by)  # type: ignore[arg-type]
    info = await engine.client.get(iid)
    assert (info.status, info.state["data"]["reminders"]) == ("COMPLETED", 3)


async def test_move_clock_only_moves_the_clock(engine: Engine) -> None:
    iid = await engine.client.start(daily, {})
    await engine.run_until_idle()
    await engine.move_clock(timedelta(days=3))
    assert (await engine.client.get(iid)).state["data"]["reminders"] == 1
    await engine.run_until_idle()  # one timer fires; the next is a day after the moved clock
    assert (await engine.client.get(iid)).state["data"]["reminders"] == 2


async def test_skipping_fires_every_schedule_tick_on_the_way(engine: Engine, db: asyncpg.Connection) -> None:
    await engine.client.schedule(Schedule("hourly", report, cron="0 * * * *", catch_up="none"))
    await engine.advance(hours=5)
    count = await db.fetchval("SELECT count(*) FROM stepstone.instances WHERE status = 'COMPLETED'")
    assert count == 5  # each tick fired on time, though catch_up="none" would drop a late one


async def test_skipping_fires_a_tasks_reminder_escalation_and_expiry_each_on_time(database_url: str) -> None:
    from tests.engine import task_workflows  # noqa: PLC0415 - the task workflows live with the task tests
    from tests.engine.task_workflows import Expense, expense  # noqa: PLC0415

    async with open_engine(database_url, task_workflows.registry) as engine:
        iid = await engine.client.start(expense, Expense(expense_id="e-1", employee="eve", amount=120.5))
        await engine.run_until_idle()
        [task] = (await engine.client.tasks(user="alice", groups=["finance"])).tasks
        await engine.client.claim_task(task.id, actor="alice", groups=["finance"])
        opened = task.created_at
        await engine.advance(days=3)  # one call: the reminder (1 h), the escalation (4 h), the expiry (2 d)
        history = {h["kind"]: h["at"] for h in await engine.client.history(iid)}
        assert (await engine.client.task(task.id)).status == "EXPIRED"
        for kind, due in (("TASK_REMINDED", timedelta(hours=1)), ("TASK_ESCALATED", timedelta(hours=4)),
                          ("TASK_EXPIRED", timedelta(days=2))):
            late = history[kind] - (opened + due)
            # At its time, not at the end of the skip. The due times count from the decision's clock
            # reading, the task's created_at from its commit a few milliseconds later: hence the second.
            assert -timedelta(seconds=1) <= late < timedelta(minutes=1), (kind, late)


async def test_advance_refuses_what_is_no_step_forward(engine: Engine) -> None:
    """inf, NaN or 1e300 days were OverflowError/ValueError from timedelta, 999,999,999 days the driver's
    'timestamp out of range', and a negative step returned as if nothing were asked."""
    before = await engine.store.db_now()
    for ask in ({"days": math.inf}, {"days": math.nan}, {"days": 1e300}, {"days": -1}, {"seconds": -5},
                {"by": -1}, {"by": timedelta(days=999_999_999)}, {"by": "soon"}):
        with pytest.raises(InvalidInput, match=r"^advance moves the clock forward, by 0 to a thousand years"):
            await engine.advance(**ask)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput, match=r"^move_clock moves the clock forward, by 0 to a thousand years"):
            await engine.move_clock(**ask)  # type: ignore[arg-type]
    assert await engine.store.db_now() - before < timedelta(minutes=1)  # the clock did not move


async def test_a_schedule_of_a_workflow_this_engine_does_not_have_is_not_waited_for(engine: Engine) -> None:
    """Another node's schedule, overdue because that node is down, is not this one's next tick: skipping
    stopped at it 10,000 times and gave up, and a worker's firer polled every 10 ms."""
    await engine.client.schedule(Schedule("theirs", "another_teams_workflow", every=60))
    await engine.client.schedule(Schedule("hourly", report, cron="0 * * * *", catch_up="none"))
    await engine.advance(minutes=3)
    assert engine.worker.schedules is not None
    gap = await engine.worker.schedules.next_tick()
    assert gap is not None and 0 < gap <= 3600  # the hourly tick, not the other node's overdue one


async def test_stops_that_move_the_clock_are_not_counted_as_a_runaway(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only stops at which the clock does not move count toward the runaway guard: a week of a minutely
    schedule is 10,080 stops on the way, every one a step forward."""
    monkeypatch.setattr(testing, "_MAX_STILL", 2)
    await engine.client.schedule(Schedule("minutely", report, cron="* * * * *", catch_up="none"))
    await engine.advance(minutes=10)  # ten stops, each a minute on
    due_now = 0.0

    async def always_due() -> float:
        return due_now

    monkeypatch.setattr(engine, "_next_due", always_due)
    with pytest.raises(RuntimeError, match="due now 2 stops in a row"):
        await engine.advance(minutes=1)
