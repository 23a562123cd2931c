"""Throughput: N three-step workflows in a closed loop, with an in-process worker (and optionally
worker processes). Starters keep at most a window of unfinished workflows outstanding; each one
finished lets the next start, so the engine runs saturated but never builds an unbounded backlog.
There is one starter per worker slot: the slots a group commit frees all at once are refilled at
once. With 4 starters for 8 slots the arrivals came in fours, and the worker's claims and group
commits followed them (4 to 6.7 step commits a statement against 8 with 8 starters; docs/performance.md,
"A starter for every slot").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import asyncpg

from stepstone.bench.common import (
    BenchContext,
    Metric,
    Progress,
    StatementLog,
    bench_database,
    bench_queries,
    track_commits,
)
from stepstone.bench.procs import WorkerProcess
from stepstone.bench.workflows import registry, three
from stepstone.client import Client
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.postgres import PostgresStore

STEPS = 3
LAST_CPU_PER_WORKFLOW = [0.0]
"""CPU seconds this process spent per workflow in the last `measure` (starts, claims, steps, commits)."""
LAST_MACHINE_BUSY: list[float | None] = [None]
"""The share of the machine's CPU time that was busy during the last `measure` (None off Linux)."""
LAST_OTHER_CPU_PER_WORKFLOW: list[float | None] = [None]
"""CPU seconds the rest of the machine (the server, on a machine that runs nothing else) spent per
workflow in the last `measure`: busy CPU time of the whole machine less this process's (None off Linux)."""


def _busy_seconds(ticks: int) -> float:
    return ticks / os.sysconf("SC_CLK_TCK")


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, all) CPU ticks of the whole machine since boot, from /proc/stat; None where it is missing.
    Busy is user, nice, system, irq and softirq; idle and iowait are not; steal is left out of both."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq = fields
    busy = user + nice + system + irq + softirq
    return busy, busy + idle + iowait


async def run(ctx: BenchContext) -> list[Metric]:
    metrics: list[Metric] = []
    async with bench_database(ctx) as url:
        rate, stats = await measure(ctx, url, ctx.sizes.workflows, processes=0)
    ctx.max_workflows_per_s = rate
    metrics += _metrics(ctx, "in-process worker", rate) + _busy_metric("in-process worker")
    cpu_us = LAST_CPU_PER_WORKFLOW[0] / STEPS * 1e6
    metrics.append(Metric("throughput", "engine CPU per step commit (in-process)", cpu_us, "us",
                          note="process CPU time of client + worker / step commits; steadier than wall time"))
    if (other := LAST_OTHER_CPU_PER_WORKFLOW[0]) is not None:
        metrics.append(Metric("throughput", "server CPU per step commit (in-process)", other / STEPS * 1e6, "us",
                              note="busy CPU time of the machine less this process's / step commits: PostgreSQL's "
                                   "share where nothing else runs"))
    workflows = ctx.sizes.workflows
    statements = stats.count("commit") + stats.count("commit_many")
    if statements:
        metrics.append(Metric("throughput", "claim statements per workflow", stats.count("claim") / workflows,
                              "statements", note="in-process worker; includes empty claims while idle"))
        metrics.append(Metric("throughput", "step commits per commit statement", workflows * STEPS / statements,
                              "commits", note="group commit: > 1 when commits are flushed together"))
    if ctx.processes:
        async with bench_database(ctx) as url:
            rate, _ = await measure(ctx, url, ctx.sizes.workflows, processes=ctx.processes)
        metrics += _metrics(ctx, f"{ctx.processes} worker processes", rate) + _busy_metric(
            f"{ctx.processes} worker processes")
    return metrics


def _busy_metric(label: str) -> list[Metric]:
    """Below 100% the run was bound by latency (slots waiting for their commits), not by CPU."""
    busy = LAST_MACHINE_BUSY[0]
    if busy is None:
        return []
    return [Metric("throughput", f"machine CPU busy ({label})", 100 * busy, "%",
                   note="all processes on this machine, server included, over the measured interval")]


def _metrics(ctx: BenchContext, label: str, rate: float) -> list[Metric]:
    ceiling = ctx.ceiling
    commits = rate * STEPS
    ratio = commits / ceiling if ceiling else None
    ctx.say(f"throughput ({label}): {rate:,.0f} workflows/s, {commits:,.0f} step commits/s"
            + (f" = {ratio:.2f} x ceiling" if ratio is not None else ""))
    return [
        Metric("throughput", f"workflows/s ({label})", rate, "workflows/s", ">= 500", rate >= 500),
        Metric("throughput", f"step commits/s ({label})", commits, "commits/s", ">= 1500 and >= 0.5 x ceiling",
               commits >= 1500 and (ratio is None or ratio >= 0.5), ratio=ratio),
    ]


@asynccontextmanager
async def engine(ctx: BenchContext, url: str, processes: int, progress: Progress) -> AsyncIterator[StatementLog | None]:
    """Workers running `registry`: in this process (yields its statement log) or in subprocesses."""
    if processes == 0:
        store = await PostgresStore.open(url, ctx.schema, max_size=ctx.concurrency + 4)
        stats = StatementLog(store)
        track_commits(store, progress)
        worker = Worker(store, registry, WorkerConfig(concurrency=ctx.concurrency, worker_id="bench-inproc"))
        await worker.start()
        try:
            yield stats
        finally:
            await worker.stop()
            await store.close()
        return
    children = [await WorkerProcess.spawn(url, ctx.schema, "--concurrency", str(ctx.concurrency),
                                          "--worker-id", f"bench-proc-{n}") for n in range(processes)]
    poller = None
    try:
        for child in children:
            await child.expect("ready")
        poller = asyncio.create_task(_poll_completed(url, ctx.schema, progress))
        yield None
    finally:
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        for child in children:
            await child.terminate()


async def _poll_completed(url: str, schema: str, progress: Progress) -> None:
    """Count the instances that end, as the server announces them (the channel an instance notifies when
    it completes). A poll of the completed count every 10 ms read every completed row each time: with
    thousands completed it took a core of its own from the worker processes it was measuring."""
    store = await PostgresStore.open(url, schema, max_size=1)
    ended = asyncio.Event()
    count = 0

    def on_end(_instance_id: str) -> None:
        nonlocal count
        count += 1
        ended.set()

    listener = await store.listen_settled(on_end)
    try:
        while True:
            await ended.wait()
            ended.clear()
            async with progress.changed:
                progress.done = count
                progress.changed.notify_all()
    finally:
        await listener.close()
        await store.close()


async def measure(ctx: BenchContext, url: str, total: int, *, processes: int) -> tuple[float, StatementLog]:
    """Workflows per second over `total` workflows after a short warm-up; and the worker's statements."""
    progress = Progress()
    starters = ctx.concurrency * max(1, processes)
    client_store = await PostgresStore.open(url, ctx.schema, max_size=starters + 2)
    client = Client(client_store, registry)
    window = 4 * starters
    warmup = min(200, max(20, total // 10))
    try:
        async with engine(ctx, url, processes, progress) as stats:
            await closed_loop(client, progress, warmup, window, starters)
            await _analyze(url, ctx.schema)
            if stats is not None:
                stats.clear()
            started, cpu, ticks = time.monotonic(), time.process_time(), _cpu_ticks()
            await closed_loop(client, progress, total, window, starters)
            elapsed = time.monotonic() - started
            own = time.process_time() - cpu
            LAST_CPU_PER_WORKFLOW[0] = own / total
            after = _cpu_ticks()
            LAST_MACHINE_BUSY[0] = LAST_OTHER_CPU_PER_WORKFLOW[0] = None
            if ticks is not None and after is not None and after[1] > ticks[1]:
                LAST_MACHINE_BUSY[0] = (after[0] - ticks[0]) / (after[1] - ticks[1])
                LAST_OTHER_CPU_PER_WORKFLOW[0] = (_busy_seconds(after[0] - ticks[0]) - own) / total
            log = stats if stats is not None else StatementLog(client_store)
    finally:
        await client_store.close()
    return total / elapsed, log


async def _analyze(url: str, schema: str) -> None:
    """Measure the steady state: the tables analyzed, as autovacuum (or the workers, `refresh_statistics`)
    keep them in a running system. A database this young would otherwise be measured on plans made while
    its tables were empty."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(bench_queries(schema)["analyze"])
    finally:
        await conn.close()


async def closed_loop(client: Client, progress: Progress, count: int, window: int, starters: int) -> None:
    """Start `count` bench_three workflows from `starters` tasks, never more than `window` unfinished; wait
    for all."""
    base = progress.done
    started = 0

    def room() -> bool:
        return started - (progress.done - base) < window

    async def starter() -> None:
        nonlocal started
        while True:
            await progress.wait_until(room, timeout=120)
            if started >= count:
                return
            started += 1
            await client.start(three, {})

    await asyncio.gather(*(starter() for _ in range(starters)))
    await progress.wait_until(lambda: progress.done - base >= count, timeout=300)
