"""The operator's tools while worker processes are SIGKILLed (the chaos rig's workers and fleet).

Retention sweeps race the workers: it purges only what has ended, never deadlocks with a commit, and
loses nothing (every instance it purged had run its last step). A bulk retry runs while a worker is
killed between its batches: its counts are exact and no instance is retried twice.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

import asyncpg

from stepstone.client import Client
from stepstone.core.pin import pin_of
from stepstone.ops import InstanceFilter, Operations
from stepstone.ops.model import RetentionReport
from stepstone.outbox.publisher import memory_publisher
from stepstone.outbox.relay import Relay
from stepstone.store.outbox import PostgresOutbox
from stepstone.store.postgres import PostgresStore
from tests._pg import PgServer
from tests.chaos import workflows
from tests.chaos.rig.fleet import Fleet
from tests.chaos.rig.scenarios import Probe, Target, scenario_database, start_instances, wait_for
from tests.ops.workflows import failed_rows

WORKERS = 3
KILLS = 4
_LIVE = "('PENDING', 'RUNNING', 'WAITING', 'COMPENSATING')"


@asynccontextmanager
async def _fleet(url: str, workdir: Path) -> AsyncIterator[Fleet]:
    fleet = Fleet(url, workdir, WORKERS, lease=1.0, concurrency=4, poll=0.2, env={workflows.PAUSE_ENV: "0.05"})
    fleet.start()
    try:
        yield fleet
    finally:
        await asyncio.to_thread(fleet.stop)


def _last_step(definition_id: str) -> str:
    """The step every instance of the rig's workflow runs last at its root (its completion's proof)."""
    family, _, n = definition_id.partition("-")
    return f"s{n}" if family == "chaos" else "s3"


async def test_retention_racing_killed_workers_purges_only_what_ended(pg_server: PgServer, tmp_path: Path) -> None:
    rng = random.Random(11)  # noqa: S311 - a reproducible workload and kill schedule
    async with scenario_database(Target(pg_server.admin_url), "ops_retention") as url:
        await start_instances(url, 80, rng, fans=0.1, parents=0.1)
        store = await PostgresStore.open(url, max_size=6)
        conn = await asyncpg.connect(url)
        definitions = {str(r["id"]): r["definition_id"]
                       for r in await conn.fetch("SELECT id, definition_id FROM stepstone.instances")}
        relay = Relay(PostgresOutbox(store), memory_publisher("memory://ops-kills"))
        ops = Operations.on(store, actor="retention-race")
        # Purge as early as possible: archived at the end, purged at the next sweep.
        await ops.set_retention_policy("*", "completed", timedelta(0), timedelta(0))
        sweeps: list[RetentionReport] = []
        racing: list[int] = []  # after each sweep that purged: how many instances were still running
        try:
            await relay.start()  # published events let their instances go; unsent ones hold them back
            async with _fleet(url, tmp_path) as fleet:
                deadline = time.monotonic() + 180

                async def all_purged() -> bool:
                    sweep = await ops.retention_run(batch_size=16)
                    sweeps.append(sweep)
                    if sweep.purged:
                        racing.append(int(await conn.fetchval(
                            f"SELECT count(*) FROM stepstone.instances WHERE status IN {_LIVE}")))
                    # An instance that has not ended is never archived, whatever the races.
                    assert await conn.fetchval(
                        f"SELECT count(*) FROM stepstone.instances WHERE archived_at IS NOT NULL AND status IN {_LIVE}"
                    ) == 0
                    if len(fleet.kills) < KILLS and len(sweeps) % 3 == 0:
                        fleet.kill(rng.randrange(WORKERS))
                    return int(await conn.fetchval("SELECT count(*) FROM stepstone.instances")) == 0

                assert await wait_for(all_purged, deadline, every=0.1), sweeps[-1]
            crashed = fleet.crashed()
            logs = "\n".join(p.stats.with_suffix(".log").read_text() for p in fleet.retired)
            ran = await conn.fetch("SELECT instance_id::text AS iid, step FROM chaos.ledger")
            deadlocks = await conn.fetchval("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
            orphans = await conn.fetchval(
                "SELECT (SELECT count(*) FROM stepstone.commands) + (SELECT count(*) FROM stepstone.positions) "
                "+ (SELECT count(*) FROM stepstone.history)")
        finally:
            await relay.stop()
            await conn.close()
            await store.close()
    assert crashed == [] and len(fleet.kills) == KILLS
    assert "deadlock" not in logs.lower() and deadlocks == 0
    # Nothing lost: every purged instance had run its last step (an instance purged while running could not).
    steps: dict[str, set[str]] = {}
    for r in ran:
        steps.setdefault(r["iid"], set()).add(r["step"])
    children = set(steps) - set(definitions)  # the parents' children, started by the workers
    assert len(children) == sum(d == workflows.PARENT.id for d in definitions.values()) > 0
    for iid, ran_steps in steps.items():
        last = _last_step(definitions.get(iid, workflows.PARENT_CHILD))
        assert last in ran_steps, f"instance {iid} was purged before it ran {last}: {sorted(ran_steps)}"
    assert set(definitions) <= set(steps)
    assert orphans == 0  # a purge takes every row of its instance, never some
    # Each instance purged exactly once, children included.
    assert sum(s.purged for s in sweeps) == len(steps)
    assert max(racing) > 0, "no sweep purged while instances were running: the test raced nothing"


HOLDERS = 12
_ARCHIVED_LIVE = (f"SELECT count(*) FROM stepstone.instances WHERE archived_at IS NOT NULL AND status IN {_LIVE}")
# A parent past its child step (waiting for the child, or running s3 on its report) whose child is gone.
_ORPHANED = (f"SELECT count(*) FROM stepstone.instances p WHERE p.definition_id = 'chaoshold-1' AND p.status IN {_LIVE}"
             " AND (p.step = 's3' OR (p.step = 's2' AND p.status = 'WAITING'))"
             " AND NOT EXISTS (SELECT 1 FROM stepstone.instances c WHERE c.parent_id = p.id)")


async def test_retention_with_a_waiting_window_keeps_live_trees_under_kills(
    pg_server: PgServer, tmp_path: Path
) -> None:
    """Parents (chaoshold-1) wait for children that wait for signals while sweeps run with zero windows for
    the waiting and completed classes and workers are SIGKILLed: no instance of a live tree is archived or
    purged (a child waiting under a live parent is counted active, migration 0073), the chains beside them
    are purged, and once the children are signalled every parent completes with its child's result."""
    rng = random.Random(17)  # noqa: S311 - a reproducible workload and kill schedule
    async with scenario_database(Target(pg_server.admin_url), "ops_live_trees") as url:
        chains = await start_instances(url, 30, rng)
        store = await PostgresStore.open(url, max_size=6)
        conn = await asyncpg.connect(url)
        client = Client(store, workflows.registry)
        parents = [await client.start(workflows.HOLDER, {}) for _ in range(HOLDERS)]
        relay = Relay(PostgresOutbox(store), memory_publisher("memory://ops-live-trees"))
        ops = Operations.on(store, actor="retention-trees")
        for status_class in ("waiting", "completed"):
            await ops.set_retention_policy("*", status_class, timedelta(0), timedelta(0))
        # The parents are archived at their end but kept, so their results can be read afterwards.
        await ops.set_retention_policy(workflows.HOLDER.id, "completed", timedelta(0), timedelta(days=1))
        sweeps: list[RetentionReport] = []
        try:
            await relay.start()
            async with _fleet(url, tmp_path) as fleet:

                async def sweep(kills: int) -> None:
                    sweeps.append(await ops.retention_run(batch_size=8))
                    assert await conn.fetchval(_ARCHIVED_LIVE) == 0  # never, whatever the window
                    assert await conn.fetchval(_ORPHANED) == 0  # a live parent's child is never purged
                    if len(fleet.kills) < kills and len(sweeps) % 3 == 0:
                        fleet.kill(rng.randrange(WORKERS))

                async def trees_waiting() -> bool:
                    await sweep(KILLS // 2)
                    return len(fleet.kills) == KILLS // 2 and await conn.fetchval(
                        "SELECT count(*) FILTER (WHERE definition_id = 'chaoshold-1' AND status = 'WAITING'"
                        "                        AND step = 's2')"
                        " + count(*) FILTER (WHERE definition_id = 'chaossig-2' AND status = 'WAITING'"
                        "                    AND step = 'w1') = $1 AND count(*) = $1"
                        " FROM stepstone.instances", 2 * HOLDERS)

                assert await wait_for(trees_waiting, time.monotonic() + 120, every=0.1), sweeps[-1]
                # Nothing moves now: the sweep's counts are exact. Every instance of the trees is a candidate
                # (a WAITING one past a zero window), none archived: a parent waits for its child, a child
                # is waited for.
                quiet = await ops.retention_run()
                assert (quiet.archived, quiet.purged, quiet.skipped_busy, quiet.skipped_active) == (
                    0, 0, 0, 2 * HOLDERS), quiet
                children = [str(r["id"]) for r in await conn.fetch(
                    "SELECT id FROM stepstone.instances WHERE parent_id IS NOT NULL ORDER BY id")]
                unsignalled = list(children)

                async def trees_done() -> bool:
                    for child in unsignalled[:3]:  # a few children at a time, between sweeps and kills
                        for n in (1, 2):
                            await client.signal(child, workflows.GO, {"n": n}, dedup_key=f"go-{n}")
                    del unsignalled[:3]
                    await sweep(KILLS)
                    return not unsignalled and len(fleet.kills) == KILLS and await conn.fetchval(
                        "SELECT count(*) FILTER (WHERE status = 'COMPLETED' AND archived_at IS NOT NULL) = $1"
                        " AND count(*) = $1 FROM stepstone.instances", HOLDERS)

                assert await wait_for(trees_done, time.monotonic() + 120, every=0.1), sweeps[-1]
            crashed = fleet.crashed()
            held = {str(r["id"]): (r["status"], json.loads(r["state"])) for r in await conn.fetch(
                "SELECT id, status, state FROM stepstone.instances")}
            ran = await conn.fetch("SELECT instance_id::text AS iid, step FROM chaos.ledger")
            deadlocks = await conn.fetchval("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
            await ops.set_retention_policy(workflows.HOLDER.id, "completed", timedelta(0), timedelta(0))

            async def published() -> bool:  # the parents' last events, which would hold their purge back
                return await conn.fetchval("SELECT count(*) FROM stepstone.outbox WHERE published_at IS NULL") == 0

            assert await wait_for(published, time.monotonic() + 60)
            last = await ops.retention_run()
            left = await conn.fetchval("SELECT count(*) FROM stepstone.instances")
        finally:
            await relay.stop()
            await conn.close()
            await store.close()
    assert crashed == [] and len(fleet.kills) == KILLS
    assert deadlocks == 0
    # Every parent completed with its own child's result: both signals, in order.
    assert sorted(held) == sorted(parents)
    assert {iid: (status, state["got"]) for iid, (status, state) in held.items()} == dict.fromkeys(
        parents, ("COMPLETED", [1, 2]))
    assert sorted(state["child_id"] for _, state in held.values()) == children
    steps: dict[str, set[str]] = {}
    for r in ran:
        steps.setdefault(r["iid"], set()).add(r["step"])
    assert {iid for iid, s in steps.items() if "s3" in s} >= {*parents, *children}
    # The counts: each chain and child archived and purged once, each parent archived once (never before
    # its end: an instance archived early and changed again would be archived a second time).
    total = len(chains) + 2 * HOLDERS
    assert sum(s.archived for s in sweeps) == total
    assert sum(s.purged for s in sweeps) == len(chains) + HOLDERS
    assert (last.archived, last.purged, left) == (0, HOLDERS, 0)


async def test_bulk_retry_while_a_worker_is_killed_counts_exactly_and_retries_each_once(
    pg_server: PgServer, tmp_path: Path
) -> None:
    size, batch = 300, 25
    async with scenario_database(Target(pg_server.admin_url), "ops_retry") as url:
        store = await PostgresStore.open(url, max_size=6)
        conn = await asyncpg.connect(url)
        probe = Probe(url)
        try:
            for wf in workflows.registry:
                await store.register(pin_of(wf), wf.plan.document())
            ids = await failed_rows(conn, workflows.CHAINS[2].plan, "s1", size, '{"n": 0}')
            ops = Operations.on(store, actor="oncall")
            where = InstanceFilter(status=("FAILED",), workflow="chaos-2")
            async with _fleet(url, tmp_path) as fleet:
                seen: list[tuple[int, int]] = []

                def progress(done: int, total: int) -> None:
                    seen.append((done, total))
                    if len(seen) % 3 == 0 and len(fleet.kills) < KILLS:
                        fleet.kill(len(seen) % WORKERS)  # the retried instances it was running are taken over

                report = await ops.retry(where=where, batch_size=batch, progress=progress)

                async def all_completed() -> bool:
                    return int(await probe.fetchval(
                        "SELECT count(*) FROM stepstone.instances WHERE status = 'COMPLETED'")) == size

                assert await wait_for(all_completed, time.monotonic() + 180)
                again = await ops.retry(where=where)  # the operator runs the same command once more
                by_id = await ops.retry(ids[:10])
            assert fleet.crashed() == [] and len(fleet.kills) == KILLS
            retries = dict(await conn.fetch(
                "SELECT instance_id::text, count(*) FROM stepstone.commands WHERE kind = 'RETRY' GROUP BY 1"))
            retried = dict(await conn.fetch(
                "SELECT instance_id::text, count(*) FROM stepstone.history WHERE kind = 'INSTANCE_RETRIED' GROUP BY 1"))
            finished = await conn.fetchval(
                "SELECT count(DISTINCT instance_id) FROM chaos.ledger WHERE step = 's2'")
        finally:
            await probe.close()
            await conn.close()
            await store.close()
    assert (report.matched, report.succeeded, report.failed) == (size, size, 0)
    assert sorted(i.id for i in report.items) == sorted(ids)  # one result each, none twice
    assert seen == [(min(n + batch, size), size) for n in range(0, size, batch)]
    assert retries == dict.fromkeys(ids, 1)  # exactly one RETRY command per instance
    assert retried == dict.fromkeys(ids, 1)
    assert finished == size
    assert (again.matched, again.succeeded) == (0, 0)
    assert (by_id.matched, by_id.succeeded, by_id.failed) == (10, 0, 10)
    assert {i.reason for i in by_id.items} == {
        "it is COMPLETED; only a FAILED or COMPENSATION_FAILED instance can be retried"}
