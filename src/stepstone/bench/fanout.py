"""Fan-out: branches of one instance running in parallel, across worker slots and worker processes.

    sleep fan-out   one `bench_fanout` instance mapping over N items of S seconds, an in-process
                    worker with N slots: wall time (the instance's start to its end, on the
                    server's clock) and its ratio to the serial time N x S.
    map             one instance mapping over M items that return at once (each writes its own
                    key of the state), on 2 worker processes (`--processes` when larger):
                    items/s, and the share of the branch steps each process ran (the
                    `claimed_by` of their settled commands).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

import asyncpg

from stepstone.bench.common import BenchContext, Metric, bench_database, bench_queries
from stepstone.bench.procs import WorkerProcess
from stepstone.bench.workflows import FanState, fanout, registry
from stepstone.client import Client
from stepstone.core.model import COMPLETED
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.postgres import PostgresStore

BRANCH_STEP = "item"


@dataclass(frozen=True)
class MapResult:
    items: int
    seconds: float
    shares: dict[str, int]
    """worker id -> branch steps it ran."""
    commits: int
    """STEP_COMPLETED rows of the branch step (one per item when no step ran twice)."""
    conflicts: int
    """Branch commits that found the shared state changed first (rebased or re-run), all processes."""


async def run(ctx: BenchContext) -> list[Metric]:
    sizes = ctx.sizes
    metrics: list[Metric] = []
    async with bench_database(ctx) as url:
        walls = [await sleep_fanout(ctx, url, sizes.fanout_branches, sizes.fanout_seconds)
                 for _ in range(sizes.fanout_repeats)]
    serial = sizes.fanout_branches * sizes.fanout_seconds
    wall = statistics.median(walls)
    ctx.say(f"fan-out {sizes.fanout_branches} x {sizes.fanout_seconds:g} s, {sizes.fanout_branches} slots: "
            f"{', '.join(f'{w:.2f}' for w in walls)} s (median {wall:.2f} s = {wall / serial:.3f} x serial "
            f"{serial:g} s)")
    label = f"{sizes.fanout_branches} branches x {sizes.fanout_seconds:g} s, {sizes.fanout_branches} slots"
    metrics.append(Metric("fanout", f"wall time ({label})", wall, "s", "about 1 s", wall <= 1.5 * sizes.fanout_seconds,
                          note=f"median of {len(walls)}: " + ", ".join(f"{w:.3f}" for w in walls)))
    metrics.append(Metric("fanout", f"wall / serial time ({label})", wall / serial, "x serial",
                          note=f"serial = {serial:g} s"))
    processes = max(2, ctx.processes)
    async with bench_database(ctx) as url:
        result = await map_spread(ctx, url, sizes.map_items, processes)
    rate = result.items / result.seconds
    shares = ", ".join(f"{w} {n / result.items:.0%}" for w, n in sorted(result.shares.items()))
    ctx.say(f"map of {result.items:,} items on {processes} processes: {result.seconds:.2f} s, {rate:,.0f} items/s; "
            f"branch steps by process: {shares}; {result.commits} branch commits, {result.conflicts} state conflicts")
    metrics.append(Metric("fanout", f"map items/s ({result.items:,} items, {processes} worker processes)", rate,
                          "items/s", note=f"{result.seconds:.2f} s from start to end"))
    for worker, steps in sorted(result.shares.items()):
        metrics.append(Metric("fanout", f"map share of branch steps ({worker})", steps / result.items * 100, "%",
                              note=f"{steps} of {result.items}"))
    metrics.append(Metric("fanout", "map state conflicts per item", result.conflicts / result.items, "conflicts",
                          note="branch commits that found the shared state changed first (rebased, or re-run)"))
    return metrics


async def _span(conn: asyncpg.Connection, query: str, instance_id: str, timeout: float) -> float:
    """Poll until the instance ended; its start-to-end seconds on the server's clock."""
    deadline = time.monotonic() + timeout
    while True:
        row = await conn.fetchrow(query, instance_id)
        if row is not None and row["seconds"] is not None:
            if row["status"] != COMPLETED:
                raise RuntimeError(f"bench_fanout {instance_id} ended {row['status']}")
            return float(row["seconds"])
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench_fanout {instance_id} did not end within {timeout:.0f} s")
        await asyncio.sleep(0.01)


async def sleep_fanout(ctx: BenchContext, url: str, branches: int, seconds: float) -> float:
    """Seconds from start to end of one fan-out of `branches` x `seconds`, with `branches` slots."""
    store = await PostgresStore.open(url, ctx.schema, max_size=branches + 4)
    conn = await asyncpg.connect(url)
    worker = Worker(store, registry, WorkerConfig(concurrency=branches, worker_id="bench-fanout"))
    await worker.start()
    try:
        instance_id = await Client(store, registry).start(fanout, FanState(items=[seconds] * branches))
        return await _span(conn, bench_queries(ctx.schema)["instance_span"], instance_id, 60 + branches * seconds)
    finally:
        await worker.stop()
        await store.close()
        await conn.close()


async def map_spread(ctx: BenchContext, url: str, items: int, processes: int) -> MapResult:
    """One map over `items` instant branches on `processes` worker processes (`ctx.concurrency` slots each)."""
    q = bench_queries(ctx.schema)
    children = [await WorkerProcess.spawn(url, ctx.schema, "--concurrency", str(ctx.concurrency),
                                          "--worker-id", f"bench-proc-{n}") for n in range(processes)]
    store = await PostgresStore.open(url, ctx.schema, max_size=2)
    conn = await asyncpg.connect(url)
    try:
        for child in children:
            await child.expect("ready")
        instance_id = await Client(store, registry).start(fanout, FanState(items=[0.0] * items))
        seconds = await _span(conn, q["instance_span"], instance_id, 300)
        shares = {str(r["worker"]): int(r["steps"]) for r in await conn.fetch(q["branch_share"], instance_id,
                                                                              BRANCH_STEP)}
        commits = int(await conn.fetchval(q["branch_attempts"], instance_id, BRANCH_STEP))
    finally:
        reports = [await child.terminate() for child in children]
        await store.close()
        await conn.close()
    conflicts = sum(int(r.get("conflicts", 0)) for r in reports if r is not None)
    return MapResult(items, seconds, shares, commits, conflicts)
