"""Throughput: N three-step workflows in a closed loop, with an in-process worker (and optionally
worker processes). Starters keep at most a window of unfinished workflows outstanding; each one
finished lets the next start, so the engine runs saturated but never builds an unbounded backlog.
There is one starter per worker slot: the slots a group commit frees all at once are refilled at
once. With 4 starters for 8 slots the arrivals came in fours, and the worker's claims and group
commits followed them (4 to 6.7 step commits a statement against 8 with 8 starters; docs/performance-history.md,
"A starter for every slot").
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from stepstone._waiting import cancel_and_wait
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
WINDOW_PER_STARTER = 4
"""Unfinished workflows a closed loop keeps outstanding, per starter."""


@dataclass(frozen=True)
class Run:
    """One measured closed loop."""

    workflows_per_s: float
    statements: StatementLog
    cpu_per_workflow: float
    """CPU seconds this process spent per workflow (starts, claims, steps, commits)."""
    machine_busy: float | None
    """The share of the machine's CPU time that was busy (None off Linux)."""
    other_cpu_per_workflow: float | None
    """CPU seconds the rest of the machine (the server, on a machine that runs nothing else) spent per
    workflow: busy CPU time of the whole machine less this process's (None off Linux)."""


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
        local = await measure(ctx, url, ctx.sizes.workflows, processes=0)
    ctx.max_workflows_per_s = local.workflows_per_s
    metrics += _metrics(ctx, "in-process worker", local)
    cpu_us = local.cpu_per_workflow / STEPS * 1e6
    metrics.append(Metric("throughput", "engine CPU per step commit (in-process)", cpu_us, "us",
                          note="process CPU time of client + worker / step commits; steadier than wall time"))
    if (other := local.other_cpu_per_workflow) is not None:
        metrics.append(Metric("throughput", "server CPU per step commit (in-process)", other / STEPS * 1e6, "us",
                              note="busy CPU time of the machine less this process's / step commits: PostgreSQL's "
                                   "share where nothing else runs"))
    workflows, stats = ctx.sizes.workflows, local.statements
    statements = stats.count("commit") + stats.count("commit_many")
    if statements:
        metrics.append(Metric("throughput", "claim statements per workflow", stats.count("claim") / workflows,
                              "statements", note="in-process worker; includes empty claims while idle"))
        metrics.append(Metric("throughput", "step commits per commit statement", workflows * STEPS / statements,
                              "commits", note="group commit: > 1 when commits are flushed together"))
    if ctx.processes:
        async with bench_database(ctx) as url:
            spread = await measure(ctx, url, ctx.sizes.workflows, processes=ctx.processes)
        metrics += _metrics(ctx, f"{ctx.processes} worker processes", spread)
    return metrics


def _metrics(ctx: BenchContext, label: str, measured: Run) -> list[Metric]:
    """Workflows/s, step commits/s against the ceiling, and how busy the machine was (below 100% the run
    was bound by latency, slots waiting for their commits, not by CPU)."""
    ceiling, rate = ctx.ceiling, measured.workflows_per_s
    commits = rate * STEPS
    ratio = commits / ceiling if ceiling else None
    ctx.say(f"throughput ({label}): {rate:,.0f} workflows/s, {commits:,.0f} step commits/s"
            + (f" = {ratio:.2f} x ceiling" if ratio is not None else ""))
    return [
        Metric("throughput", f"workflows/s ({label})", rate, "workflows/s", ">= 500", rate >= 500),
        Metric("throughput", f"step commits/s ({label})", commits, "commits/s", ">= 1500 and >= 0.5 x ceiling",
               commits >= 1500 and (ratio is None or ratio >= 0.5), ratio=ratio),
    ] + ([] if measured.machine_busy is None else [
        Metric("throughput", f"machine CPU busy ({label})", 100 * measured.machine_busy, "%",
               note="all processes on this machine, server included, over the measured interval"),
    ])


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
            await cancel_and_wait(poller)  # a Ctrl-C of the bench itself still goes through
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


async def measure(ctx: BenchContext, url: str, total: int, *, processes: int) -> Run:
    """`total` workflows after a short warm-up: their rate, the worker's statements, the CPU they took."""
    progress = Progress()
    starters = ctx.concurrency * max(1, processes)
    client_store = await PostgresStore.open(url, ctx.schema, max_size=starters + 2)
    client = Client(client_store, registry)
    warmup = min(200, max(20, total // 10))
    try:
        async with engine(ctx, url, processes, progress) as stats:
            await closed_loop(client, progress, warmup, starters)
            await _analyze(url, ctx.schema)
            if stats is not None:
                stats.clear()
            started, cpu, ticks = time.monotonic(), time.process_time(), _cpu_ticks()
            await closed_loop(client, progress, total, starters)
            elapsed = time.monotonic() - started
            own = time.process_time() - cpu
            after = _cpu_ticks()
            busy = other = None
            if ticks is not None and after is not None and after[1] > ticks[1]:
                busy = (after[0] - ticks[0]) / (after[1] - ticks[1])
                other = (_busy_seconds(after[0] - ticks[0]) - own) / total
            log = stats if stats is not None else StatementLog(client_store)
    finally:
        await client_store.close()
    return Run(total / elapsed, log, own / total, busy, other)


async def _analyze(url: str, schema: str) -> None:
    """Measure the steady state: the tables analyzed, as autovacuum (or the workers, `refresh_statistics`)
    keep them in a running system. A database this young would otherwise be measured on plans made while
    its tables were empty."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(bench_queries(schema)["analyze"])
    finally:
        await conn.close()


async def closed_loop(client: Client, progress: Progress, count: int, starters: int) -> None:
    """Start `count` bench_three workflows from `starters` tasks, never more than `WINDOW_PER_STARTER` a
    starter unfinished; wait for all."""
    window = WINDOW_PER_STARTER * starters
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
