"""A rolling deploy while worker processes are SIGKILLed (docs/versions.md, "Rolling deploys"): two
workers run the old release (version 1 of `chaosmove-2` alone) and two the new one (version 2 alone),
while instances of both versions run and wait for their signal. A worker that lacks an instance's pinned
version must leave it to one that has it (deferred, never failed, and routed to that release: no command
is deferred twice), and a killed worker's work is taken over by a worker of the same release.

What must hold afterwards: every instance COMPLETED on the version it started on (the path of that version,
no INSTANCE_MIGRATED), every handler ran on a worker of the release that has the instance's version (the
ledger names the worker), no dead letter, each step visit committed once with its effect in the ledger,
histories gapless.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import asyncpg

from stepstone.client import Client
from stepstone.store.postgres import PostgresStore
from tests._pg import PgServer
from tests.chaos import workflows
from tests.chaos.rig import checker
from tests.chaos.rig.fleet import Fleet
from tests.chaos.rig.scenarios import Probe, Target, fleet_run, kill_as_commits_go, scenario_database

EACH = 30  # instances of each version
KILLS = 6
KILL_EVERY = 12  # step commits between two kills: the kills follow the run's progress, not the clock
RELEASES = {0: "moving", 1: "moving", 2: "moved", 3: "moved"}  # slot -> the release it runs


async def test_a_rolling_deploy_under_kills_runs_each_version_on_its_own_release(
        pg_server: PgServer, tmp_path: Path) -> None:
    rng = random.Random(43)  # noqa: S311 - a reproducible kill schedule
    async with scenario_database(Target(pg_server.admin_url), "rolling") as url:
        store = await PostgresStore.open(url, max_size=4)
        fleet = Fleet(url, tmp_path, len(RELEASES), lease=1.0, concurrency=4, poll=0.2,
                      env={workflows.PAUSE_ENV: "0.05"}, parts=RELEASES)
        probe = Probe(url)

        async def settled() -> bool:
            return int(await probe.fetchval(
                "SELECT count(*) FROM stepstone.instances WHERE status = 'COMPLETED'")) == 2 * EACH

        deadline = time.monotonic() + 150
        client = Client(store, workflows.registry)
        async with fleet_run(fleet, probe, client.close):
            ids = [await client.start(workflows.MOVING, {}) for _ in range(EACH)]
            ids += [await client.start(workflows.MOVED, {"currency": "EUR"}) for _ in range(EACH)]
            fleet.start()
            for iid in rng.sample(ids, len(ids)):  # queued behind s1, applied once the wait opens
                await client.signal(iid, workflows.GO, {}, dedup_key="go")
            await kill_as_commits_go(fleet, probe, settled, kills=KILLS, every=KILL_EVERY, rng=rng,
                                     deadline=deadline)
            for iid in ids:  # each one's settle notification (Client.wait_for)
                await client.wait_for(iid, timeout=max(1.0, deadline - time.monotonic()))
        conn = await asyncpg.connect(url)
        try:
            await checker.assert_none(conn, _NOTHING)
            deferred = await conn.fetchval("SELECT coalesce(sum(deferrals), 0) FROM stepstone.commands")
            twice = await conn.fetch("SELECT id, kind, deferrals FROM stepstone.commands WHERE deferrals > 1")
            took = await conn.fetch(_TOOK)
        finally:
            await conn.close()
    assert len(fleet.kills) >= 3
    assert deferred > 0, "no worker met an instance of the other release's version"
    # A deferral routes the command to the workers that have its pin (migration 0076): the other release
    # never claims it again, killed workers and expired leases included.
    assert twice == [], f"commands deferred more than once: {[dict(r) for r in twice]}"
    print(f"rolling deploy kills: {len(fleet.kills)} kills, {2 * EACH} instances on their own release, "  # noqa: T201
          f"{deferred} deferrals; start -> end p50 / max by version: "
          + ", ".join(f"v{r['version']} {r['p50']:.1f} / {r['max']:.1f} s" for r in took))


_TOOK = (
    "SELECT version, percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM ended_at - created_at)) AS p50, "
    "max(extract(epoch FROM ended_at - created_at)) AS max FROM stepstone.instances GROUP BY version ORDER BY version")

_RELEASE_OF_SLOT = " ".join(f"WHEN 'w{slot}' THEN {1 if part == 'moving' else 2}" for slot, part in RELEASES.items())

_NOTHING = {
    "instances not completed on the path of the version they started on": (
        "SELECT i.id, i.version, i.state FROM stepstone.instances i WHERE NOT ("
        "(i.version = 1 AND i.state = '{\"ran\": [\"v1:s1\", \"v1:s2\"]}'::jsonb) OR "
        "(i.version = 2 AND i.state = '{\"ran\": [\"v2:s1\", \"v2:s2\", \"v2:s3\"], \"currency\": \"EUR\"}'::jsonb))"
        " OR i.status <> 'COMPLETED'"),
    "migrated instances": "SELECT instance_id FROM stepstone.history WHERE kind = 'INSTANCE_MIGRATED'",
    "handlers run on a worker of the other release": (
        "SELECT l.instance_id, l.step, l.worker, i.version FROM chaos.ledger l "
        "JOIN stepstone.instances i ON i.id = l.instance_id "
        f"WHERE (CASE split_part(l.worker, ':', 1) {_RELEASE_OF_SLOT} END) IS DISTINCT FROM i.version"),
    "dead letters": "SELECT id, instance_id, last_error FROM stepstone.commands WHERE state = 'DEAD'",
    "committed steps without their effect": checker.LOST_WRITES,
    "step visits committed twice": checker.STEP_TWICE,
    "histories with a gap": checker.HISTORY_GAPS,
}
