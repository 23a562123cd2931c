"""Migrating running instances while worker processes are SIGKILLed (`chaosmove-2`, docs/versions.md
"Migrating running instances"): instances of version 1 run s1 and wait for `go`; two operators migrate
every instance of version 1 to version 2 at once (a state transform adds the `currency` version 2's state
needs), while the signals of half of the instances race the migrations and workers die. The other half
is signalled only once both migrations have answered.

What must hold afterwards: every instance COMPLETED, either on version 1 (`ran` is v1:s1, v1:s2) with no
INSTANCE_MIGRATED entry, or on version 2 (v1:s1, v2:s2, v2:s3, with the currency) with exactly one; the
two operators' `migrated` answers add up to the entries (nothing migrated twice, nothing refused); every
instance signalled after the migrations moved; each step visit committed once with its effect in the
ledger; histories gapless.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import asyncpg

from stepstone.client import Client
from stepstone.store.postgres import PostgresStore
from tests._pg import PgServer
from tests.chaos import workflows
from tests.chaos.rig import checker
from tests.chaos.rig.fleet import Fleet
from tests.chaos.rig.scenarios import Probe, Target, fleet_run, kill_as_commits_go, scenario_database, wait_for

SIZE = 60
WORKERS = 3
KILLS = 6
KILL_EVERY = 12  # step commits between two kills: the kills follow the run's progress, not the clock


def add_currency(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "currency": "EUR"}


async def test_migrations_under_kills_move_each_instance_once(pg_server: PgServer, tmp_path: Path) -> None:
    rng = random.Random(41)  # noqa: S311 - a reproducible schedule of kills and signals
    async with scenario_database(Target(pg_server.admin_url), "migrations") as url:
        store = await PostgresStore.open(url, max_size=6)
        fleet = Fleet(url, tmp_path, WORKERS, lease=1.0, concurrency=4, poll=0.2, env={workflows.PAUSE_ENV: "0.05"})
        probe = Probe(url)

        async def settled() -> bool:
            return int(await probe.fetchval(
                "SELECT count(*) FROM stepstone.instances WHERE status = 'COMPLETED'")) == SIZE

        async def half_waiting() -> bool:
            return int(await probe.fetchval(
                "SELECT count(*) FROM stepstone.instances WHERE step = 'w'")) >= SIZE // 2

        deadline = time.monotonic() + 150
        client = Client(store, workflows.registry)
        async with fleet_run(fleet, probe, client.close):
            ids = [await client.start(workflows.MOVING, {}) for _ in range(SIZE)]
            racing, after = ids[: SIZE // 2], ids[SIZE // 2 :]
            fleet.start()
            killing = asyncio.create_task(kill_as_commits_go(
                fleet, probe, settled, kills=KILLS, every=KILL_EVERY, rng=rng, deadline=deadline))
            assert await wait_for(half_waiting, deadline, every=0.05), "instances never reached their wait"

            async def migrate_all() -> Any:
                return await client.migrate(to=workflows.MOVED, definition="chaosmove-2", from_version=1,
                                            state_transform=add_currency, patience=60)

            async def signal_racing() -> None:
                for iid in rng.sample(racing, len(racing)):
                    await client.signal(iid, workflows.GO, {}, dedup_key="go")
                    await asyncio.sleep(0)

            _, first, second = await asyncio.gather(signal_racing(), migrate_all(), migrate_all())
            for iid in after:
                await client.signal(iid, workflows.GO, {}, dedup_key="go")
            for iid in ids:  # each one's settle notification (Client.wait_for)
                await client.wait_for(iid, timeout=max(1.0, deadline - time.monotonic()))
            await killing
        conn = await asyncpg.connect(url)
        try:
            await checker.assert_none(conn, _NOTHING)
            rows = await conn.fetch(_OUTCOMES)
        finally:
            await conn.close()
    by_id = {str(r["id"]): r for r in rows}
    assert len(by_id) == SIZE
    migrated = sum(r["migrations"] for r in rows)
    answered = [o.outcome for o in (*first.outcomes, *second.outcomes)]
    assert "refused" not in answered, [o for o in (*first.outcomes, *second.outcomes) if o.outcome == "refused"]
    assert answered.count("migrated") == migrated
    assert all(by_id[iid]["version"] == 2 for iid in after), "an instance signalled after its migration stayed"
    assert len(fleet.kills) >= 3
    moved_racing = sum(1 for iid in racing if by_id[iid]["version"] == 2)
    print(f"migration kills: {len(fleet.kills)} kills, {migrated} of {SIZE} instances migrated "  # noqa: T201
          f"({moved_racing} of the {len(racing)} whose signal raced the migrations)")


_OUTCOMES = (
    "SELECT i.id, i.version, (SELECT count(*) FROM stepstone.history h WHERE h.instance_id = i.id "
    "AND h.kind = 'INSTANCE_MIGRATED') AS migrations FROM stepstone.instances i")

_NOTHING = {
    "instances not completed": "SELECT id, status FROM stepstone.instances WHERE status <> 'COMPLETED'",
    "instances whose path does not match their version, or migrated other than once on version 2": (
        "SELECT i.id, i.version, i.state, (SELECT count(*) FROM stepstone.history h WHERE h.instance_id = i.id "
        "AND h.kind = 'INSTANCE_MIGRATED') AS n FROM stepstone.instances i WHERE NOT ("
        "(i.version = 1 AND i.state = '{\"ran\": [\"v1:s1\", \"v1:s2\"]}'::jsonb) OR "
        "(i.version = 2 AND i.state = '{\"ran\": [\"v1:s1\", \"v2:s2\", \"v2:s3\"], \"currency\": \"EUR\"}'::jsonb))"
        " OR (SELECT count(*) FROM stepstone.history h WHERE h.instance_id = i.id "
        "AND h.kind = 'INSTANCE_MIGRATED') <> i.version - 1"),
    "committed steps without their effect": checker.LOST_WRITES,
    "step visits committed twice": checker.STEP_TWICE,
    "histories with a gap": checker.HISTORY_GAPS,
}
