"""Latency: open loop at 50% of the measured maximum, and signal -> next step started.

Start -> completed is measured on one clock (this process's monotonic clock) from each workflow's
*scheduled* start time, so a late start counts against the engine (no coordinated omission).
Completion is the moment the commit that ended the instance returned to the worker.
"""

from __future__ import annotations

import asyncio
import time

from stepstone.bench.common import (
    BenchContext,
    Metric,
    Progress,
    StatementLog,
    bench_database,
    percentile,
    track_commits,
)
from stepstone.bench.workflows import SIGNAL_SEEN, registry, signal_wf, three
from stepstone.client import Client
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.factory import open_store
from stepstone.store.postgres import PostgresStore

DEFAULT_MAX = 500.0
"""Workflows/s assumed when the throughput workload did not run first."""
IN_FLIGHT = 16
"""Starts the open loop has outstanding at most (a start due while 16 are in flight waits its turn)."""


async def run(ctx: BenchContext) -> list[Metric]:
    rate = 0.5 * (ctx.max_workflows_per_s or DEFAULT_MAX)
    async with bench_database(ctx) as url:
        progress = Progress()
        worker_store = await PostgresStore.open(url, ctx.schema, max_size=ctx.concurrency + 4)
        client_store = await open_store(url, ctx.schema, max_size=16)
        track_commits(worker_store, progress)
        statements = StatementLog(worker_store)
        client = Client(client_store, registry)
        worker = Worker(worker_store, registry, WorkerConfig(concurrency=ctx.concurrency, worker_id="bench-latency"))
        await worker.start()
        try:
            statements.clear()
            idle = await signal_latencies(client, progress, ctx.sizes.signal_samples)
            idle_claims = statements.count("claim") / max(1, len(idle))
            load = asyncio.create_task(open_loop(client, progress, rate, ctx.sizes.latency_seconds))
            loaded = await signal_latencies(client, progress, ctx.sizes.signal_samples,
                                            until=load, spacing=ctx.sizes.latency_seconds / ctx.sizes.signal_samples)
            e2e = await load
        finally:
            await worker.stop()
            await client_store.close()
            await worker_store.close()
    ms = [x * 1000 for x in e2e]
    idle_ms = [x * 1000 for x in idle]
    loaded_ms = [x * 1000 for x in loaded]
    p50, p99 = percentile(ms, 50), percentile(ms, 99)
    ctx.say(f"latency at {rate:,.0f} workflows/s: start->completed p50 {p50:.1f} ms p99 {p99:.1f} ms; "
            f"signal->step p99 idle {percentile(idle_ms, 99):.1f} ms, loaded {percentile(loaded_ms, 99):.1f} ms")
    note = f"open loop at {rate:,.0f} workflows/s (50% of max), {len(ms)} workflows"
    return [
        Metric("latency", "start->completed p50", p50, "ms", "<= 15", p50 is not None and p50 <= 15, note=note),
        Metric("latency", "start->completed p99", p99, "ms", "<= 60", p99 is not None and p99 <= 60, note=note),
        *_pair("signal->next step, idle", idle_ms, target_p99=3),  # issue 17 item 4 tightened 15 ms to 3
        # The start's claim and the signal's; more is a wake-up that claimed nothing (a timer's, before
        # the worker learnt to wait for a future command's due time).
        Metric("latency", "claim statements per idle signal", idle_claims, "statements",
               note="2.0 = the start's claim and the signal's"),
        *_pair("signal->next step, 50% load", loaded_ms, target_p99=None),
    ]


def _pair(label: str, values: list[float], target_p99: float | None) -> list[Metric]:
    p50, p99 = percentile(values, 50), percentile(values, 99)
    met = None if target_p99 is None else (p99 is not None and p99 <= target_p99)
    return [
        Metric("latency", f"{label} p50", p50, "ms", note=f"{len(values)} signals"),
        Metric("latency", f"{label} p99", p99, "ms", None if target_p99 is None else f"<= {target_p99:g}", met),
    ]


async def open_loop(client: Client, progress: Progress, rate: float, seconds: float) -> list[float]:
    """Start workflows at `rate`/s for `seconds`; each one's completion time minus its scheduled start."""
    count = max(1, int(rate * seconds))
    scheduled: dict[str, float] = {}
    sem = asyncio.Semaphore(IN_FLIGHT)

    async def start(at: float) -> None:
        async with sem:
            iid = await client.start(three, {})
        scheduled[iid] = at

    tasks = []
    origin = time.monotonic()
    for i in range(count):
        at = origin + i / rate
        delay = at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(start(at)))
    await asyncio.gather(*tasks)
    await progress.wait_until(lambda: all(i in progress.ended for i in scheduled), timeout=120)
    return [progress.ended[i] - at for i, at in scheduled.items()]


async def signal_latencies(
    client: Client, progress: Progress, samples: int, *, until: asyncio.Task[list[float]] | None = None,
    spacing: float = 0.0,
) -> list[float]:
    """Signal instances waiting in `bench_signal` one at a time; time from the send to the next step's start."""
    found: list[float] = []
    for _ in range(samples):
        if until is not None and until.done():
            break
        iid = await client.start(signal_wf, {})
        await progress.wait_until(lambda iid=iid: iid in progress.waiting, timeout=60)
        sent = time.monotonic()
        await client.signal(iid, "go")
        await progress.wait_until(lambda iid=iid: iid in progress.ended, timeout=60)
        found.append(SIGNAL_SEEN.pop(iid) - sent)
        if spacing:
            await asyncio.sleep(spacing)
    return found
