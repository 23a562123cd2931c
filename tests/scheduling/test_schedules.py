"""Schedules fire from the database clock: exactly one start per tick across workers and restarts,
the catch-up and overlap policies, pause, resume, trigger and delete."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import asyncpg
import pytest

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.scheduling import Schedule
from stepstone.scheduling.operations import ScheduleNotFound
from stepstone.testing import Engine, open_engine
from tests.scheduling.workflows import Job, long, registry, report

HOUR = timedelta(hours=1)


async def _to_next_hour(engine: Engine) -> None:
    """Move the clock to 30 s past the next full hour (a cron tick of "0 * * * *")."""
    now = await engine.store.db_now()
    nxt = (now + HOUR).replace(minute=0, second=30, microsecond=0)
    await engine.move_clock(nxt - now)


async def _instances(db: asyncpg.Connection, definition: str = "report") -> list[asyncpg.Record]:
    return await db.fetch("SELECT id, status, state, created_at FROM stepstone.instances WHERE definition_id = $1 "
                          "ORDER BY created_at, id", definition)


async def test_a_tick_starts_the_workflow_once(engine: Engine, db: asyncpg.Connection) -> None:
    info = await engine.client.schedule(Schedule("hourly", report, cron="0 * * * *", input={"kind": "hourly"}))
    assert info.workflow == "report" and info.next_fire_at > await engine.store.db_now()
    await engine.run_until_idle()
    assert await _instances(db) == []  # not due yet
    await _to_next_hour(engine)
    await engine.run_until_idle()
    await engine.run_until_idle()  # again: the tick is spent
    rows = await _instances(db)
    assert len(rows) == 1 and rows[0]["status"] == "COMPLETED"
    assert rows[0]["state"]["kind"] == "hourly" and rows[0]["state"]["data"] == {"built": True}
    [info] = await engine.client.schedules()
    assert info.fired == 1 and info.last_instance == str(rows[0]["id"])
    history = await engine.client.history(str(rows[0]["id"]))
    assert history[0]["actor"] == "schedule:hourly"


async def test_three_workers_through_two_restarts_start_each_tick_once(
    engine: Engine, db: asyncpg.Connection,
) -> None:
    # Start 1 s past a full minute, so that each round's 60 s hold exactly one tick whatever the wall clock does
    # meanwhile: made at an arbitrary second, the run (seconds on a loaded machine) crossed a minute of real
    # time in some round, which found two ticks due and failed the count ("round 9: [0, 0, 2]").
    await engine.move_clock(timedelta(seconds=61 - (await engine.store.db_now()).timestamp() % 60))
    await engine.client.schedule(Schedule("minutely", report, cron="* * * * *", catch_up="all", overlap="allow"))
    workers = [engine.new_worker() for _ in range(3)]
    for w in workers:
        await w.register()
    ticks = 0
    for round_ in range(12):
        await engine.move_clock(60)
        ticks += 1
        if round_ in (4, 8):  # two restarts: every worker replaced by a new one
            workers = [engine.new_worker() for _ in range(3)]
        fired = await asyncio.gather(*(w.schedules.fire_due() for w in workers if w.schedules))
        assert sum(fired) == 1, f"round {round_}: {fired}"
    rows = await _instances(db)
    assert len(rows) == ticks
    keys = await db.fetch("SELECT key FROM stepstone.dedup WHERE kind = 'START' ORDER BY key")
    assert len({k["key"] for k in keys}) == ticks  # one idempotency key per tick, each used once
    [info] = await engine.client.schedules()
    assert info.fired == ticks


async def test_many_concurrent_firers_never_start_a_tick_twice(engine: Engine, db: asyncpg.Connection) -> None:
    # Ticks of `every` are aligned to the epoch: start 1 s after one, so that the five minutes hold 30
    # ticks whatever the wall clock does meanwhile (a schedule made 20 ms before a tick saw a 31st come
    # due while the firers ran, and the test counted it).
    await engine.move_clock(timedelta(seconds=11 - (await engine.store.db_now()).timestamp() % 10))
    await engine.client.schedule(
        Schedule("every", report, every=timedelta(seconds=10), catch_up="all", overlap="allow"))
    workers = [engine.new_worker() for _ in range(6)]
    await engine.move_clock(timedelta(minutes=5))
    await asyncio.gather(*(w.schedules.fire_due() for w in workers for _ in range(3) if w.schedules))
    assert len(await _instances(db)) == 30


@pytest.mark.parametrize(("catch_up", "expected"), [("none", 0), ("one", 1), ("all", 3)])
async def test_catch_up_after_downtime(engine: Engine, db: asyncpg.Connection, catch_up: str, expected: int) -> None:
    await engine.client.schedule(
        Schedule("s", report, cron="0 * * * *", catch_up=catch_up, overlap="allow"))  # type: ignore[arg-type]
    await _to_next_hour(engine)
    await engine.move_clock(2 * HOUR + timedelta(minutes=5))  # three ticks went by, the last one 5 min ago
    await engine.run_until_idle()
    assert len(await _instances(db)) == expected
    [info] = await engine.client.schedules()
    assert info.next_fire_at > await engine.store.db_now()


async def test_catch_up_all_with_overlap_skip_runs_the_first_missed_tick_only(
    engine: Engine, db: asyncpg.Connection,
) -> None:
    await engine.client.schedule(Schedule("s", report, cron="0 * * * *", catch_up="all"))
    await _to_next_hour(engine)
    await engine.move_clock(2 * HOUR)
    await engine.run_until_idle()
    assert len(await _instances(db)) == 1
    [info] = await engine.client.schedules()
    assert (info.fired, info.skipped) == (1, 2)


async def test_overlap_skip_allow_and_cancel_previous(engine: Engine, db: asyncpg.Connection) -> None:
    for overlap in ("skip", "allow", "cancel_previous"):
        await engine.client.schedule(Schedule(overlap, long, cron="0 * * * *", overlap=overlap))  # type: ignore[arg-type]
    for _ in range(2):
        await _to_next_hour(engine)
        await engine.run_until_idle()
    by_name = {s.name: s for s in await engine.client.schedules()}
    assert (by_name["skip"].fired, by_name["skip"].skipped) == (1, 1)
    assert by_name["allow"].fired == 2
    assert by_name["cancel_previous"].fired == 2
    rows = await db.fetch("SELECT i.status, h.actor FROM stepstone.instances i "
                          "JOIN stepstone.history h ON h.instance_id = i.id AND h.seq = 1 ORDER BY i.created_at, i.id")
    statuses: dict[str, list[str]] = {}
    for r in rows:
        statuses.setdefault(r["actor"].removeprefix("schedule:"), []).append(r["status"])
    assert statuses["skip"] == ["WAITING"]
    assert statuses["allow"] == ["WAITING", "WAITING"]
    assert sorted(statuses["cancel_previous"]) == ["CANCELLED", "WAITING"]
    # once the running one ends, skip fires again
    await engine.client.signal(by_name["skip"].last_instance or "", "done")
    await engine.run_until_idle()
    await _to_next_hour(engine)
    await engine.run_until_idle()
    assert (await engine.client.schedules("skip"))[0].fired == 2


async def test_pause_resume_trigger_delete(engine: Engine, db: asyncpg.Connection) -> None:
    await engine.client.schedule(Schedule("s", report, cron="0 * * * *"))
    await engine.client.pause_schedule("s")
    await _to_next_hour(engine)
    await engine.run_until_idle()
    assert await _instances(db) == []
    info = await engine.client.resume_schedule("s")  # the missed tick does not fire
    assert not info.paused and info.next_fire_at > await engine.store.db_now()
    await engine.run_until_idle()
    assert await _instances(db) == []
    iid = await engine.client.trigger_schedule("s")
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"
    await engine.client.delete_schedule("s")
    assert await engine.client.schedules() == []
    for op in (engine.client.pause_schedule, engine.client.resume_schedule, engine.client.delete_schedule,
               engine.client.trigger_schedule):
        with pytest.raises(ScheduleNotFound, match="no schedule named 's'"):
            await op("s")


async def test_declaring_it_again_keeps_its_next_tick(engine: Engine) -> None:
    first = await engine.client.schedule(Schedule("s", report, cron="0 * * * *"))
    await engine.move_clock(timedelta(minutes=90))
    again = await engine.client.schedule(Schedule("s", report, cron="0 * * * *"))
    assert again.next_fire_at == first.next_fire_at  # still due: a redeploy does not drop the tick
    changed = await engine.client.schedule(Schedule("s", report, cron="30 * * * *"))
    assert changed.next_fire_at > await engine.store.db_now()


async def test_a_worker_without_the_workflow_leaves_the_schedule_to_others(engine: Engine) -> None:
    await engine.client.schedule(Schedule("s", report, every=60))
    await engine.move_clock(120)
    from stepstone.authoring.workflow import Registry  # noqa: PLC0415
    from stepstone.runtime.worker import Worker  # noqa: PLC0415

    other = Worker(engine.store, Registry(long))
    assert other.schedules is not None and await other.schedules.fire_due() == 0
    assert (await engine.client.schedules())[0].fired == 0
    assert registry.latest("report") is not None
    await engine.run_until_idle()
    assert (await engine.client.schedules())[0].fired == 1


async def test_bad_schedules_are_refused_in_one_line(engine: Engine) -> None:
    from stepstone.errors import InvalidInput  # noqa: PLC0415

    with pytest.raises(InvalidInput, match=r"schedule 's': cron expression '61 \* \* \* \*'"):
        await engine.client.schedule(Schedule("s", report, cron="61 * * * *"))
    with pytest.raises(InvalidInput):
        await engine.client.schedule(Schedule("s", report, every=60, input={"kind": 5}))


_timed: Workflow[Job] = Workflow("timed", version=1, state=Job, deadline=600)


@_timed.step(start=True, next="hold", deadline=60)
async def _open(ctx: StepContext, state: Job) -> None:
    state.data["opened"] = True


_timed.wait("hold", signals={"done": _timed.end()})


async def test_a_ticks_instance_gets_the_workflows_deadlines_as_a_start_does(
    database_url: str, db: asyncpg.Connection,
) -> None:
    """An instance a schedule started never timed out: the tick gave it neither the workflow's default
    deadline nor its action start step's deadline, which `client.start` (and start_or_signal) give."""
    async with open_engine(database_url, Registry(_timed)) as engine:
        await engine.client.schedule(Schedule("timed-hourly", _timed, every=HOUR))
        # Just past the first tick (the ticks are on the hour): a full hour would also pass the deadlines
        # whenever the test runs later than a few minutes past an hour, and their claims move the timers.
        now = await db.fetchval("SELECT stepstone.db_now()")
        await engine.advance(seconds=HOUR.total_seconds() - now.timestamp() % HOUR.total_seconds() + 1)
        [row] = await _instances(db, "timed")
        # counted from the firing (the instance's creation), as a start's are from the start; not from the
        # START command's available_at, which its claim moves to the lease's expiry
        timers = await db.fetch(
            "SELECT t.name, t.available_at - i.created_at AS after FROM stepstone.commands t "
            "JOIN stepstone.instances i ON i.id = t.instance_id "
            "WHERE t.instance_id = $1 AND t.kind = 'TIMER' ORDER BY t.id", row["id"])
        assert [(t["name"], round(t["after"].total_seconds())) for t in timers] == [
            ("deadline", 600), ("step_deadline", 60)]
        await engine.advance(minutes=11)
        assert (await engine.client.get(str(row["id"]))).status == "TIMED_OUT"
