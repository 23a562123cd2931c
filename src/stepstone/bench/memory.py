"""Memory: peak RSS of a worker process holding N steps in flight (handlers waiting on an event)."""

from __future__ import annotations

import asyncio

from stepstone.bench.common import BenchContext, Metric, bench_database
from stepstone.bench.procs import WorkerProcess
from stepstone.bench.workflows import hold_wf, registry
from stepstone.client import Client
from stepstone.store.factory import open_store


async def run(ctx: BenchContext) -> list[Metric]:
    n = ctx.sizes.memory_in_flight
    async with bench_database(ctx) as url:
        child = await WorkerProcess.spawn(url, ctx.schema, "--concurrency", str(n), "--worker-id", "bench-memory",
                                          "--hold", "--hold-target", str(n))
        store = await open_store(url, ctx.schema, max_size=8)
        try:
            ready = await child.expect("ready")
            client = Client(store, registry)
            sem = asyncio.Semaphore(8)

            async def start() -> None:
                async with sem:
                    await client.start(hold_wf, {})

            await asyncio.gather(*(start() for _ in range(n)))
            holding = await child.expect("holding", timeout=120)
            done = await child.terminate(timeout=120)
        finally:
            child.kill()
            await store.close()
    peak_kb = max(holding["maxrss_kb"], (done or {}).get("maxrss_kb", 0))
    mb = peak_kb / 1024
    ctx.say(f"memory: worker peak RSS {mb:.0f} MB with {holding['entered']} steps in flight "
            f"(idle worker {ready['maxrss_kb'] / 1024:.0f} MB)")
    return [
        Metric("memory", "idle worker RSS", ready["maxrss_kb"] / 1024, "MB"),
        Metric("memory", f"worker peak RSS, {n:,} in flight", mb, "MB", "<= 200", mb <= 200,
               note="VmHWM of the worker process (its own peak, not its parent's), through drain"),
    ]
