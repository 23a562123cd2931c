"""Worker processes SIGKILLed while sagas compensate: every completed step is compensated, in reverse
order, each exactly once in the history; a compensation's effect repeats only when a kill fell inside
that effect's effect -> commit window (the interrupted handler runs again), and none is skipped."""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import asyncpg

from stepstone.client import Client
from stepstone.core.pin import pin_of
from stepstone.store.postgres import PostgresStore
from tests._pg import PgServer
from tests.chaos import workflows
from tests.chaos.rig import checker
from tests.chaos.rig.fleet import Fleet
from tests.chaos.rig.scenarios import Probe, Target, fleet_run, scenario_database, wait_for

SIZE = 40
WORKERS = 3
KILLS = 6  # then the fleet finishes in peace (CI time)
_ENDED = "('COMPENSATED', 'COMPENSATION_FAILED', 'FAILED', 'CANCELLED', 'COMPLETED')"


async def _start(url: str, n: int) -> list[str]:
    store = await PostgresStore.open(url, max_size=4)
    try:
        for wf in workflows.registry:
            await store.register(pin_of(wf), wf.plan.document())
        client = Client(store, workflows.registry)
        return list(await asyncio.gather(*(client.start(workflows.SAGA, {}) for _ in range(n))))
    finally:
        await store.close()


async def _at_least(count: Any, target: int, ended: Any) -> bool:
    return await count() >= target or bool(await ended())


async def test_kills_mid_compensation_skip_nothing_and_repeat_only_the_interrupted(
    pg_server: PgServer, tmp_path: Path
) -> None:
    rng = random.Random(7)  # noqa: S311 - a reproducible kill schedule
    async with scenario_database(Target(pg_server.admin_url), "sagas") as url:
        ids = await _start(url, SIZE)
        fleet = Fleet(url, tmp_path, WORKERS, lease=1.0, concurrency=4, poll=0.2,
                      env={workflows.PAUSE_ENV: "0.2"})
        fleet.start()
        probe = Probe(url)

        async def ended() -> bool:
            return int(await probe.fetchval(f"SELECT count(*) FROM stepstone.instances WHERE status IN {_ENDED}")) \
                == SIZE

        async def compensating() -> bool:
            return bool(await probe.fetchval("SELECT count(*) FROM stepstone.instances WHERE status = 'COMPENSATING'"))

        async def compensations() -> int:
            return int(await probe.fetchval("SELECT count(*) FROM stepstone.history WHERE kind = 'STEP_COMPENSATED'"))

        in_flight: list[int] = []

        async def one_in_flight() -> bool:
            """A worker in the middle of a compensation: its effect is written, its commit is not."""
            pid = await probe.fetchval(
                "SELECT pid FROM chaos.ledger WHERE key LIKE '%/compensate/%' "
                "AND at > clock_timestamp() - interval '100 ms' ORDER BY at DESC LIMIT 1")
            in_flight[:] = [p.slot for p in fleet.procs.values() if p.pid == pid][:1]
            return bool(in_flight) or await ended()

        deadline = time.monotonic() + 150
        async with fleet_run(fleet, probe):
            await wait_for(compensating, deadline, every=0.02)  # the kills are for the compensations
            while time.monotonic() < deadline and len(fleet.kills) < KILLS and not await ended():
                if not await wait_for(one_in_flight, deadline, every=0.01) or not in_flight:
                    continue
                fleet.kill(in_flight[0])
                # The next kill once the survivors have committed a few more compensations: a schedule
                # paced by the engine's progress, not by the clock.
                target = await compensations() + rng.randint(2, 6)
                await wait_for(functools.partial(_at_least, compensations, target, ended), deadline, every=0.01)
            assert await wait_for(ended, deadline)
        conn = await asyncpg.connect(url)
        try:
            statuses = dict(await conn.fetch("SELECT status, count(*) FROM stepstone.instances GROUP BY 1"))
            assert statuses == {"COMPENSATED": SIZE}
            compensated = await conn.fetch(
                "SELECT instance_id::text AS iid, step FROM stepstone.history WHERE kind = 'STEP_COMPENSATED' "
                "ORDER BY instance_id, seq")
            order: dict[str, list[str]] = defaultdict(list)
            for r in compensated:
                order[r["iid"]].append(r["step"])
            assert set(order) == set(ids)
            assert {tuple(v) for v in order.values()} == {("s2", "s1")}  # reverse order, each once
            assert await conn.fetchval("SELECT count(*) FROM stepstone.compensations WHERE status <> 'COMPENSATED'") \
                == 0
            rows = await conn.fetch(
                "SELECT key, pid, attempt, extract(epoch FROM at)::float8 AS at FROM chaos.ledger "
                "WHERE key LIKE '%/compensate/%' ORDER BY key, at")
        finally:
            await conn.close()
    effects: dict[str, list[tuple[int, float, int]]] = defaultdict(list)
    for r in rows:
        effects[r["key"]].append((r["pid"], r["at"], r["attempt"]))
    assert len(effects) == 2 * SIZE  # nothing skipped: every compensation's effect happened
    kill_at = {k["pid"]: k["at"] for k in fleet.kills}
    repeated = {key: runs for key, runs in effects.items() if len(runs) > 1}
    for key, runs in repeated.items():
        reasons = checker.explain(key, runs, retried=set(), kill_at=kill_at, fenced_on={}, paused={})
        assert all(reasons[:-1]), (key, runs, reasons)  # each repeat: its predecessor's run was killed
    assert len(fleet.kills) >= 5
    assert repeated, "no kill landed inside a compensation: the test exercised nothing"
    print(f"saga kills: {len(fleet.kills)} kills, {len(repeated)} compensations repeated after a kill")  # noqa: T201
