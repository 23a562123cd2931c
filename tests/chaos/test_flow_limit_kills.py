"""A flow limit while worker processes are SIGKILLed (`chaos-3` limited to two running instances per value of
its state's `n`, two buckets of 30 instances, on 3 workers of 4 slots each: the limit, not the slots, bounds
how many run). Every instance must complete; in each bucket no more than two may be running at any moment,
judged from the ledger (an instance's first and last effect lie inside the time it was admitted and not yet
ended, so more than two such spans overlapping is more than two admitted); and once all have ended no slot
may be left held and no instance left queued. Every committed step once, with its effect; histories
gapless. An admission is made by the commit that ends an instance of the bucket (or by a start that finds a
free slot), so kills falling between a step and its commit exercise what a dead worker's slot becomes.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import asyncpg

from stepstone.client import Client
from stepstone.core.pin import pin_of
from stepstone.store.postgres import PostgresStore
from tests._pg import PgServer
from tests.chaos import workflows
from tests.chaos.rig import checker
from tests.chaos.rig.fleet import Fleet
from tests.chaos.rig.scenarios import Probe, Target, fleet_run, kill_as_commits_go, scenario_database, wait_for

SIZE = 60
BUCKETS = (0, 1000)  # the state's `n` at the start: the flow key's two values
LIMIT = 2
WORKERS = 3
KILLS = 6
KILL_EVERY = 12  # step commits between two kills: the kills follow the run's progress, not the clock
CHAIN = workflows.CHAINS[3]


async def _start(url: str) -> list[str]:
    store = await PostgresStore.open(url, max_size=4)
    try:
        for wf in workflows.registry:
            await store.register(pin_of(wf), wf.plan.document())
        client = Client(store, workflows.registry)
        await client.set_flow_limit(CHAIN, max_running=LIMIT, key="n")
        return [await client.start(CHAIN, {"n": BUCKETS[i % 2]}) for i in range(SIZE)]
    finally:
        await store.close()


async def test_a_flow_limit_holds_and_frees_its_slots_under_kills(pg_server: PgServer, tmp_path: Path) -> None:
    rng = random.Random(17)  # noqa: S311 - a reproducible kill schedule
    async with scenario_database(Target(pg_server.admin_url), "flow_limits") as url:
        started = await _start(url)
        fleet = Fleet(url, tmp_path, WORKERS, lease=1.0, concurrency=4, poll=0.2,
                      env={workflows.PAUSE_ENV: "0.05"})
        fleet.start()
        probe = Probe(url)
        most_admitted = 0

        async def settled() -> bool:
            nonlocal most_admitted
            # A sample beside the ledger's account: instances admitted (out of the queue) and not ended.
            most_admitted = max(most_admitted, int(await probe.fetchval(_ADMITTED_NOW)))
            return int(await probe.fetchval(
                "SELECT count(*) FROM stepstone.instances WHERE status = 'COMPLETED'")) == SIZE

        deadline = time.monotonic() + 150
        async with fleet_run(fleet, probe):
            await kill_as_commits_go(fleet, probe, settled, kills=KILLS, every=KILL_EVERY, rng=rng,
                                     deadline=deadline)
            assert await wait_for(settled, deadline), "not every instance completed"
        conn = await asyncpg.connect(url)
        try:
            statuses = dict(await conn.fetch("SELECT id::text, status FROM stepstone.instances"))
            assert statuses == dict.fromkeys(started, "COMPLETED")
            overlaps = {r["bucket"]: r["most"] for r in await conn.fetch(_MOST_OVERLAPPING)}
            await checker.assert_none(conn, _NOTHING)
        finally:
            await conn.close()
    assert len(fleet.kills) >= 3
    assert set(overlaps) == {str(b) for b in BUCKETS}
    assert max(overlaps.values()) <= LIMIT, f"more than {LIMIT} instances of a bucket ran at once: {overlaps}"
    assert most_admitted <= LIMIT * len(BUCKETS), f"{most_admitted} admitted at once"
    # The limit was what bounded the run: each bucket had its two running together at some moment.
    assert min(overlaps.values()) == LIMIT, overlaps
    print(f"flow limit kills: {len(fleet.kills)} kills, most running at once per bucket {overlaps}")  # noqa: T201


_ADMITTED_NOW = (
    "SELECT count(*) FROM stepstone.instances i WHERE i.ended_at IS NULL "
    "AND NOT EXISTS (SELECT 1 FROM stepstone.flow_queue q WHERE q.instance_id = i.id)")

# Per bucket, the most instances whose span from first to last ledger effect overlap at one moment: a span
# begins (+1) at its first effect and ends (-1) at its last; at equal times an end counts first.
_MOST_OVERLAPPING = """
WITH spans AS (
    SELECT i.flow_key AS bucket, min(l.at) AS first_at, max(l.at) AS last_at
    FROM chaos.ledger l JOIN stepstone.instances i ON i.id = l.instance_id
    GROUP BY i.id, i.flow_key
), edges AS (
    SELECT bucket, first_at AS at, 1 AS delta FROM spans
    UNION ALL
    SELECT bucket, last_at, -1 FROM spans
), running AS (
    SELECT bucket, sum(delta) OVER (PARTITION BY bucket ORDER BY at, delta ROWS UNBOUNDED PRECEDING) AS now
    FROM edges
)
SELECT bucket, max(now) AS most FROM running GROUP BY bucket
"""

_NOTHING = {
    "slots still held once every instance ended": "SELECT * FROM stepstone.flow_slots WHERE running <> 0",
    "instances still queued for a slot": "SELECT * FROM stepstone.flow_queue",
    "instances without their bucket": "SELECT id FROM stepstone.instances WHERE flow_key IS NULL",
    "completed instances whose three steps did not commit once each":
        "SELECT i.id FROM stepstone.instances i WHERE (SELECT count(*) FROM stepstone.history h "
        "WHERE h.instance_id = i.id AND h.kind = 'STEP_COMPLETED') <> 3",
    "committed steps without their effect": checker.LOST_WRITES,
    "step visits committed twice": checker.STEP_TWICE,
    "histories with a gap": checker.HISTORY_GAPS,
}
