"""A schedule firing every second while worker processes are SIGKILLed (`chaos-2`, `overlap="allow"`,
`catch_up="all"`: docs/schedules.md promises that every tick, missed ones included, starts exactly one
instance). Any of the 3 workers fires it; kills are paced by step commits, and once the whole fleet is
stopped for three ticks, then killed at once, so that ticks pass while no worker runs and are caught up.
Then the schedule is paused and the run settles. Every tick from the first to the last starts one
instance (one start key per tick, the ticks a second apart without a gap), no tick twice, the schedule's
`fired` count equals the instances, every instance completes with its two steps committed once and their
effects; histories gapless.
"""

from __future__ import annotations

import random
import time
from datetime import timedelta
from pathlib import Path

import asyncpg

from stepstone.client import Client
from stepstone.core.pin import pin_of
from stepstone.scheduling import Schedule
from stepstone.store.postgres import PostgresStore
from tests._pg import PgServer
from tests.chaos import workflows
from tests.chaos.rig import checker
from tests.chaos.rig.fleet import Fleet
from tests.chaos.rig.scenarios import Probe, Target, fleet_run, kill_as_commits_go, scenario_database, wait_for

NAME = "chaos-tick"
EVERY = timedelta(seconds=1)
MISSED = 3  # ticks that come due while no worker runs (the blackout)
TICKS = 24  # at least this many ticks fire before the schedule is paused
WORKERS = 3
KILLS = 6
KILL_EVERY = 6  # step commits between two kills (a tick's instance commits two)
CHAIN = workflows.CHAINS[2]


async def test_a_schedule_under_kills_starts_one_instance_per_tick(pg_server: PgServer, tmp_path: Path) -> None:
    rng = random.Random(29)  # noqa: S311 - a reproducible kill schedule
    async with scenario_database(Target(pg_server.admin_url), "schedules") as url:
        store = await PostgresStore.open(url, max_size=4)
        client = Client(store, workflows.registry)
        await store.register(pin_of(CHAIN), CHAIN.plan.document())
        await client.schedule(Schedule(NAME, CHAIN, every=EVERY, overlap="allow", catch_up="all"))
        fleet = Fleet(url, tmp_path, WORKERS, lease=1.0, concurrency=4, poll=0.2, env={workflows.PAUSE_ENV: "0.05"})
        fleet.start()
        probe = Probe(url)

        async def fired() -> int:
            return int(await probe.fetchval("SELECT fired FROM stepstone.schedules WHERE name = $1", NAME))

        async def enough() -> bool:
            return await fired() >= TICKS

        async def overdue() -> bool:
            return bool(await probe.fetchval(
                f"SELECT now() - next_fire_at >= interval '{MISSED} s' FROM stepstone.schedules WHERE name = $1",
                NAME))

        async def settled() -> bool:
            return not await probe.fetchval(
                "SELECT count(*) FROM stepstone.instances WHERE status <> 'COMPLETED'") \
                and not await probe.fetchval(
                    "SELECT count(*) FROM stepstone.commands WHERE state IN ('PENDING', 'DEFERRED', 'CLAIMED')")

        deadline = time.monotonic() + 150
        async with fleet_run(fleet, probe, store.close):
            await kill_as_commits_go(fleet, probe, enough, kills=KILLS // 2, every=KILL_EVERY, rng=rng,
                                     deadline=deadline)
            before = await fired()
            # A blackout: every worker stopped while ticks come due, then killed (and replaced) at once; the
            # ticks that passed meanwhile are caught up by the new workers.
            paused_at = time.time()
            for slot in range(WORKERS):
                fleet.pause(slot)
            assert await wait_for(overdue, deadline, every=0.05)
            for slot in range(WORKERS):
                fleet.kill(slot)
            await kill_as_commits_go(fleet, probe, enough, kills=KILLS + WORKERS, every=KILL_EVERY, rng=rng,
                                     deadline=deadline)
            assert await wait_for(enough, deadline), "the schedule did not fire its ticks"
            await client.pause_schedule(NAME)
            assert await wait_for(settled, deadline), "instances left moving"
        conn = await asyncpg.connect(url)
        try:
            await checker.assert_none(conn, _NOTHING)
            row = await conn.fetchrow(_TICKS)
            schedule = await conn.fetchrow("SELECT fired, skipped FROM stepstone.schedules WHERE name = $1", NAME)
            instances = await conn.fetchval("SELECT count(*) FROM stepstone.instances")
            caught_up = await conn.fetchval(_CAUGHT_UP, paused_at)
        finally:
            await conn.close()
    assert row["ticks"] == row["distinct_ticks"] == instances == schedule["fired"], (dict(row), dict(schedule))
    assert schedule["skipped"] == 0
    # The ticks are every second from the first to the last: none lost.
    assert row["span"] == row["ticks"] - 1, dict(row)
    assert len(fleet.kills) >= 3 + WORKERS
    assert before < instances
    assert caught_up >= MISSED, f"only {caught_up} ticks were caught up after the blackout"
    print(f"schedule kills: {len(fleet.kills)} kills, {instances} ticks each started once, "  # noqa: T201
          f"{caught_up} caught up after the blackout")


_TICKS = (
    "SELECT count(*) AS ticks, count(DISTINCT key) AS distinct_ticks, "
    "  (max(split_part(key, ':', 3)::bigint) - min(split_part(key, ':', 3)::bigint)) / 1000000 AS span "
    f"FROM stepstone.dedup WHERE kind = 'START' AND key LIKE 'schedule:{NAME}:%'")

# Instances of ticks since the blackout began started a second or more after their tick: caught up.
_CAUGHT_UP = (
    "SELECT count(*) FROM stepstone.dedup d JOIN stepstone.instances i ON i.id::text = d.target "
    "WHERE d.kind = 'START' AND i.created_at >= to_timestamp(split_part(d.key, ':', 3)::bigint / 1e6) "
    "+ interval '1 s' AND to_timestamp(split_part(d.key, ':', 3)::bigint / 1e6) >= to_timestamp($1)")

_NOTHING = {
    "instances without exactly one tick": (
        "SELECT i.id, count(d.*) FROM stepstone.instances i LEFT JOIN stepstone.dedup d "
        "ON d.kind = 'START' AND d.target = i.id::text GROUP BY i.id HAVING count(d.*) <> 1"),
    "instances not started by the schedule": (
        "SELECT i.id, h.actor FROM stepstone.instances i JOIN stepstone.history h ON h.instance_id = i.id "
        f"AND h.seq = 1 WHERE h.actor IS DISTINCT FROM 'schedule:{NAME}'"),
    "instances not completed with their two steps once": (
        "SELECT i.id, i.status FROM stepstone.instances i WHERE i.status <> 'COMPLETED' OR (SELECT count(*) "
        "FROM stepstone.history h WHERE h.instance_id = i.id AND h.kind = 'STEP_COMPLETED') <> 2"),
    "committed steps without their effect": checker.LOST_WRITES,
    "step visits committed twice": checker.STEP_TWICE,
    "histories with a gap": checker.HISTORY_GAPS,
}
