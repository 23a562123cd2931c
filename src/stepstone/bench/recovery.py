"""Recovery: SIGKILL a worker process with steps in flight; time until every affected instance resumed.

The victim runs with a short lease and holds its bench_hold handlers; a surviving worker in this
process (already running, as another replica would be) takes them over when the leases expire.
"""

from __future__ import annotations

import asyncio
import time

from stepstone.bench.common import BenchContext, Metric, Progress, bench_database, track_commits
from stepstone.bench.procs import WorkerProcess
from stepstone.bench.workflows import hold_wf, registry
from stepstone.client import Client
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.factory import open_store

LEASE = 2.0


async def run(ctx: BenchContext) -> list[Metric]:
    n = ctx.sizes.recovery_instances
    async with bench_database(ctx) as url:
        victim = await WorkerProcess.spawn(url, ctx.schema, "--concurrency", str(n), "--lease", str(LEASE),
                                           "--worker-id", "bench-victim", "--hold", "--hold-target", str(n))
        store = await open_store(url, ctx.schema, max_size=ctx.concurrency + 4)
        progress = Progress()
        track_commits(store, progress)
        survivor = Worker(store, registry, WorkerConfig(concurrency=ctx.concurrency, lease_seconds=LEASE,
                                                         worker_id="bench-survivor"))
        try:
            await victim.expect("ready")
            client = Client(store, registry)
            ids = set(await asyncio.gather(*(client.start(hold_wf, {}) for _ in range(n))))
            await victim.expect("holding")
            await survivor.start()
            killed = time.monotonic()
            victim.kill()
            await progress.wait_until(lambda: ids <= progress.ended.keys(), timeout=LEASE * 10 + 30)
            resumed = [progress.ended[i] - killed for i in ids]
        finally:
            victim.kill()
            await victim.proc.wait()
            await survivor.stop()
            await store.close()
    worst = max(resumed)
    ctx.say(f"recovery: {n} instances resumed within {worst:.2f} s of SIGKILL (lease {LEASE:g} s)")
    return [
        Metric("recovery", "last instance resumed after SIGKILL", worst, "s", f"<= lease {LEASE:g} s + 2 s",
               worst <= LEASE + 2, note=f"{n} steps in flight; first resumed after {min(resumed):.2f} s"),
    ]
