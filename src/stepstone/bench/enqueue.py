"""Enqueue: starts per second with no worker running, one at a time, concurrently, and in batches
(`Client.start_many`: a thousand per statement, two statements in flight); then the concurrent starts
again beside a busy worker in the same process (issue 17: starts must not starve there)."""

from __future__ import annotations

import asyncio
import time

from stepstone.bench.common import BenchContext, Metric, bench_database
from stepstone.bench.workflows import registry, three
from stepstone.client import Client
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.factory import open_store


async def run(ctx: BenchContext) -> list[Metric]:
    n = ctx.sizes.enqueue
    async with bench_database(ctx) as url:
        store = await open_store(url, ctx.schema, max_size=ctx.concurrency)
        client = Client(store, registry)
        try:
            await client.start(three, {})  # registers the definition outside the timing
            started = time.monotonic()
            for _ in range(n):
                await client.start(three, {})
            serial = n / (time.monotonic() - started)

            concurrent = await _concurrently(ctx, client, n)

            batch = ctx.sizes.batch_starts
            started = time.monotonic()
            await client.start_many(three, [{}] * batch)
            batched = batch / (time.monotonic() - started)

            # The same concurrent starts while a worker in this process works off the batch above: they
            # share its event loop (the worker on a pool of its own, as `stepstone worker` would have).
            worker_store = await open_store(url, ctx.schema, max_size=ctx.concurrency + 4)
            worker = Worker(worker_store, registry, WorkerConfig(concurrency=ctx.concurrency, worker_id="bench-enq"))
            await worker.start()
            try:
                await asyncio.sleep(0.2)  # the worker has claimed and is busy
                beside_worker = await _concurrently(ctx, client, n)
            finally:
                await worker.stop(drain_timeout=0)
                await worker_store.close()
        finally:
            await store.close()
    ctx.say(f"enqueue: {serial:,.0f} starts/s one at a time, {concurrent:,.0f} with {ctx.concurrency} tasks "
            f"({beside_worker:,.0f} beside a busy worker), {batched:,.0f} in batches")
    ceiling, serial_ceiling = ctx.ceiling, ctx.serial_ceiling
    return [
        Metric("enqueue", "starts/s, one at a time", serial, "starts/s", ">= 4000", serial >= 4000,
               ratio=serial / ceiling if ceiling else None),
        Metric("enqueue", "one-at-a-time starts per one-client ceiling commit", serial / serial_ceiling
               if serial_ceiling else None, "x", note="1.00 = as fast as a one-statement commit from one client"),
        Metric("enqueue", f"starts/s, {ctx.concurrency} concurrent", concurrent, "starts/s",
               ratio=concurrent / ceiling if ceiling else None),
        Metric("enqueue", f"starts/s, {ctx.concurrency} concurrent, a busy worker in the process", beside_worker,
               "starts/s", ratio=beside_worker / concurrent if concurrent else None,
               note="x = of the same starts with no worker running"),
        Metric("enqueue", f"starts/s, start_many of {batch:,}", batched, "starts/s", ">= 20000", batched >= 20000,
               note="1,000 per statement, 2 statements in flight"),
    ]


async def _concurrently(ctx: BenchContext, client: Client, n: int) -> float:
    """Starts/s of `n` single starts from `ctx.concurrency` tasks."""
    remaining = n

    async def starter() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await client.start(three, {})

    started = time.monotonic()
    await asyncio.gather(*(starter() for _ in range(ctx.concurrency)))
    return n / (time.monotonic() - started)
