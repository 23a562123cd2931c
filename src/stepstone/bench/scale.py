"""Scale: claim and commit cost with few and with many waiting instances; bytes per waiting instance.

Waiting instances (half on a 30-day timer, half on a signal wait with a 30-day timeout) are
bulk-inserted with generate_series in the shape the engine writes them: the instance row, its
settled START command, its pending TIMER and three history rows. Each size has a database of its own,
both seeded with the small size and run through the same workflows first; the large one is then
seeded to the large size, and the sizes are measured in alternating rounds (`measure`).
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
ROUNDS = 4
"""Closed loops per size, alternating between the sizes' databases (see `measure`)."""
WARM_UP = 20
EMPTY_ROUNDS = 10
EMPTY_CLAIMS = 100
"""Rounds of empty claims per size, each on a connection of its own, and claims a round."""


async def run(ctx: BenchContext) -> list[Metric]:
    q = bench_queries(ctx.schema)
    small, large = ctx.sizes.scale_small, ctx.sizes.scale_large
    pin = pin_of(waiting)
    async with bench_database(ctx) as small_url, bench_database(ctx) as large_url:
        # Both databases start alike: the small seed, then workflows run through it, whose newer ids put
        # the large seed's entries in the middle of every index keyed by instance, as in a live system.
        for url in (small_url, large_url):
            conn = await asyncpg.connect(url)
            try:
                await seed(conn, ctx.schema, pin, 1, small)
                await one_round(ctx, url, q, ctx.sizes.scale_workflows)
                await conn.execute(q["analyze"])
            finally:
                await conn.close()
        conn = await asyncpg.connect(large_url)
        try:
            before = await relation_bytes(conn, q)
            started = time.monotonic()
            await seed(conn, ctx.schema, pin, small + 1, large)  # ANALYZEs after
            seeded = time.monotonic() - started
            after = await relation_bytes(conn, q)
        finally:
            await conn.close()
        per_table = {k: (after[k] - before[k]) / (large - small) for k in after}
        per_instance = sum(per_table.values())
        results = await measure(ctx, {small: small_url, large: large_url}, q)
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


async def measure(ctx: BenchContext, urls: dict[int, str], q: dict[str, str]) -> dict[int, dict[str, float]]:
    """Per size: median claim and commit round trips over closed loops of three-step workflows, WAL a
    workflow, and the median empty claim (nothing ready); each size on its own database.

    The sizes take turns (small, large, then large, small, ...) and each size's samples are pooled. A
    round measured alone says as much about its minute, and its connection, as about its size: on the
    same tables the empty claim's median (about 0.2 ms) moved by 15-50% from one round to the next, and
    measuring 1,000 waiting first and a million after the seed read +126% in one full run and -1% in
    another (docs/performance-history.md, "Scale, measured in alternating rounds").
    """
    samples: dict[int, dict[str, list[float]]] = {size: {"claim": [], "commit": [], "empty": [], "wal": []}
                                                  for size in urls}
    order = sorted(urls)
    per_round = max(1, ctx.sizes.scale_workflows // ROUNDS)
    for r in range(ROUNDS):
        for size in order if r % 2 == 0 else order[::-1]:
            for key, values in (await one_round(ctx, urls[size], q, per_round)).items():
                samples[size][key] += values
    for r in range(EMPTY_ROUNDS):
        for size in order if r % 2 == 0 else order[::-1]:
            samples[size]["empty"] += await empty_claims(ctx, urls[size])
    return {size: {
        "claim_ms": statistics.median(got["claim"]) * 1000,
        # A commit statement carries one step commit or, grouped, several: the median statement.
        "commit_ms": statistics.median(got["commit"]) * 1000,
        "empty_claim_ms": statistics.median(got["empty"]) * 1000,
        "wal_per_workflow": sum(got["wal"]) / (per_round * ROUNDS),
    } for size, got in samples.items()}


async def empty_claims(ctx: BenchContext, url: str) -> list[float]:
    """EMPTY_CLAIMS claims with nothing ready, on a fresh store: their round trips (s)."""
    store = await PostgresStore.open(url, ctx.schema, max_size=4)
    stats = StatementLog(store)
    served = Worker(store, registry, WorkerConfig(worker_id="bench-scale")).served
    try:
        for _ in range(EMPTY_CLAIMS):  # as the worker claims: only the definitions it serves
            await store.claim(ctx.concurrency, 30.0, "bench-scale", served)
    finally:
        await store.close()
    return stats.seconds("claim")


async def one_round(ctx: BenchContext, url: str, q: dict[str, str], workflows: int) -> dict[str, list[float]]:
    """A closed loop of `workflows` three-step workflows on a fresh store and worker: the claims' and
    commits' round trips (s), and the loop's WAL (bytes)."""
    progress = Progress()
    store = await PostgresStore.open(url, ctx.schema, max_size=ctx.concurrency + 4)
    client_store = await open_store(url, ctx.schema, max_size=ctx.concurrency + 2)
    conn = await asyncpg.connect(url)
    client = Client(client_store, registry)
    stats = StatementLog(store)
    track_commits(store, progress)
    worker = Worker(store, registry, WorkerConfig(concurrency=ctx.concurrency, worker_id="bench-scale"))
    try:
        await worker.start()
        await closed_loop(client, progress, WARM_UP, ctx.concurrency)
        stats.clear()
        wal_from = await conn.fetchval(q["wal_position"])
        await closed_loop(client, progress, workflows, ctx.concurrency)
        wal = float(await conn.fetchval(q["wal_bytes_since"], wal_from))
        await worker.stop()
        return {"claim": stats.seconds("claim"),
                "commit": stats.seconds("commit") + stats.seconds("commit_many"), "wal": [wal]}
    finally:
        await conn.close()
        await client_store.close()
        await store.close()
