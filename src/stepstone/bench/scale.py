"""Scale: claim and commit cost with few and with many waiting instances; bytes per waiting instance.

Waiting instances (half on a 30-day timer, half on a signal wait with a 30-day timeout) are
bulk-inserted with generate_series in the shape the engine writes them: the instance row, its
settled START command, its pending TIMER and three history rows.
"""

from __future__ import annotations

import statistics
import time

import asyncpg

from stepstone.bench.common import (
    BenchContext,
    Metric,
    Progress,
    StatementLog,
    bench_database,
    bench_queries,
    seed_waiting,
    track_commits,
)
from stepstone.bench.throughput import closed_loop
from stepstone.bench.workflows import registry, waiting
from stepstone.client import Client
from stepstone.core.pin import Pin, pin_of
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.factory import open_store
from stepstone.store.postgres import PostgresStore

BATCH = 200_000
EMPTY_CLAIMS = 200


async def run(ctx: BenchContext) -> list[Metric]:
    q = bench_queries(ctx.schema)
    small, large = ctx.sizes.scale_small, ctx.sizes.scale_large
    results: dict[int, dict[str, float]] = {}
    async with bench_database(ctx) as url:
        conn = await asyncpg.connect(url)
        try:
            pin = pin_of(waiting)
            await seed(conn, ctx.schema, pin, 1, small)
            results[small] = await measure(ctx, url, conn, q)
            before = await relation_bytes(conn, q)
            started = time.monotonic()
            await seed(conn, ctx.schema, pin, small + 1, large)
            seeded = time.monotonic() - started
            after = await relation_bytes(conn, q)
            per_table = {k: (after[k] - before[k]) / (large - small) for k in after}
            per_instance = sum(per_table.values())
            results[large] = await measure(ctx, url, conn, q)
        finally:
            await conn.close()
    # Where the bytes are, largest first: what item 3's target has left to take (docs/performance.md).
    where = ", ".join(f"{name} {size:,.0f}" for name, size in sorted(per_table.items(), key=lambda kv: -kv[1]))
    ctx.say(f"scale: seeded {large - small:,} waiting instances in {seeded:.0f} s, {per_instance:,.0f} bytes each")
    ctx.say(f"scale: of which {where}")
    metrics: list[Metric] = []
    for key, label in (("claim_ms", "claim"), ("commit_ms", "commit"), ("empty_claim_ms", "empty claim")):
        a, b = results[small][key], results[large][key]
        growth = b / a - 1
        ctx.say(f"scale: {label} {a:.3f} ms at {small:,}, {b:.3f} ms at {large:,} ({growth:+.0%})")
        metrics += [
            Metric("scale", f"{label} p50, {small:,} waiting", a, "ms"),
            Metric("scale", f"{label} p50, {large:,} waiting", b, "ms", "within 25%", growth <= 0.25,
                   note=f"{growth:+.1%} vs {small:,} waiting"),
        ]
    a, b = results[small]["wal_per_workflow"], results[large]["wal_per_workflow"]
    ctx.say(f"scale: WAL {a:,.0f} bytes a workflow at {small:,}, {b:,.0f} at {large:,} ({b / a - 1:+.0%})")
    metrics += [Metric("scale", f"WAL bytes per three-step workflow, {n:,} waiting", v, "bytes",
                       note="server-wide, checkpoints' full-page images included")
                for n, v in ((small, a), (large, b))]
    metrics.append(Metric("scale", "bytes on disk per waiting instance", per_instance, "bytes",
                          "<= 1,200", per_instance <= 1200, note=where))
    return metrics


async def relation_bytes(conn: asyncpg.Connection, q: dict[str, str]) -> dict[str, int]:
    """Bytes on disk of each table with a waiting instance's rows: '<table> rows' and '<table> indexes'."""
    sizes: dict[str, int] = {}
    for r in await conn.fetch(q["relation_bytes"]):
        sizes[f"{r['name']} rows"], sizes[f"{r['name']} indexes"] = int(r["rows"]), int(r["indexes"])
    return sizes


async def seed(conn: asyncpg.Connection, schema: str, pin: Pin, first: int, last: int) -> None:
    for lo in range(first, last + 1, BATCH):
        async with conn.transaction():
            await seed_waiting(conn, schema, pin, lo, min(last, lo + BATCH - 1))
    await conn.execute(bench_queries(schema)["analyze"])


async def measure(ctx: BenchContext, url: str, conn: asyncpg.Connection, q: dict[str, str]) -> dict[str, float]:
    """Median claim and commit round trips over a closed loop of three-step workflows, and empty claims."""
    progress = Progress()
    store = await PostgresStore.open(url, ctx.schema, max_size=ctx.concurrency + 4)
    client_store = await open_store(url, ctx.schema, max_size=6)
    client = Client(client_store, registry)
    stats = StatementLog(store)
    track_commits(store, progress)
    worker = Worker(store, registry, WorkerConfig(concurrency=ctx.concurrency, worker_id="bench-scale"))
    try:
        for _ in range(EMPTY_CLAIMS):  # as the worker claims: only the definitions it serves
            await store.claim(ctx.concurrency, 30.0, "bench-scale", worker.served)
        empty = statistics.median(stats.seconds("claim"))
        await worker.start()
        await closed_loop(client, progress, 50, 4 * ctx.concurrency)
        stats.clear()
        wal_from = await conn.fetchval(q["wal_position"])
        await closed_loop(client, progress, ctx.sizes.scale_workflows, 4 * ctx.concurrency)
        wal = int(await conn.fetchval(q["wal_bytes_since"], wal_from))
        await worker.stop()
    finally:
        await client_store.close()
        await store.close()
    await conn.execute(q["analyze"])
    return {
        "claim_ms": statistics.median(stats.seconds("claim")) * 1000,
        # A commit statement carries one step commit or, grouped, several: the median statement.
        "commit_ms": statistics.median(stats.seconds("commit") + stats.seconds("commit_many")) * 1000,
        "empty_claim_ms": empty * 1000,
        "wal_per_workflow": wal / ctx.sizes.scale_workflows,
    }
