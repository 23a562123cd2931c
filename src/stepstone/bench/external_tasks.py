"""External tasks: how fast outside workers drain a topic through the Python client.

    N payment instances (stepstone.examples.payments) are started and run to their external step, so
    N tasks are open; W workers then fetch and lock (batches of 50) and complete each task, side by
    side, until none is left. answers/s = N / wall time from the first fetch to the last completion
    (each completion is one fenced transaction inserting the EXTERNAL_COMPLETION command). Then the
    engine runs the completions: instances/s from the first claim to the last instance completed.
"""

from __future__ import annotations

import asyncio
import time

from stepstone.bench.common import BenchContext, Metric, bench_database
from stepstone.examples.payments import payment, registry
from stepstone.external.tasks import ExternalTasks
from stepstone.testing import open_engine

BATCH = 50


async def run(ctx: BenchContext) -> list[Metric]:
    return await measure(ctx, 500 if ctx.sizes.name == "quick" else 5_000)


async def measure(ctx: BenchContext, count: int, workers: int = 4) -> list[Metric]:
    async with bench_database(ctx) as db, open_engine(db, registry, schema=ctx.schema,
                                                      concurrency=ctx.concurrency) as engine:
        for n in range(count):
            await engine.client.start(payment, {"order_id": f"b-{n}", "amount": n})
        await engine.run_until_idle()
        tasks = ExternalTasks(engine.store)
        started = time.perf_counter()
        done = await asyncio.gather(*(_drain(tasks, f"bench-{w}") for w in range(workers)))
        answers = time.perf_counter() - started
        assert sum(done) == count, f"{sum(done)} of {count} tasks answered"
        started = time.perf_counter()
        await engine.run_until_idle()
        engine_seconds = time.perf_counter() - started
    rate, resumed = count / answers, count / engine_seconds
    ctx.say(f"external tasks: {rate:,.0f} answers/s ({workers} workers, batches of {BATCH}); "
            f"instances resumed {resumed:,.0f}/s")
    note = f"{count} tasks, {workers} Python-client workers side by side, fetch batches of {BATCH}"
    return [
        Metric("external", "fetch and complete", rate, "tasks/s", note=note),
        Metric("external", "completions run by the engine", resumed, "instances/s",
               note=f"{count} EXTERNAL_COMPLETION commands, concurrency {ctx.concurrency}"),
    ]


async def _drain(tasks: ExternalTasks, worker: str) -> int:
    answered = 0
    while batch := await tasks.fetch_and_lock(worker, ["payments"], max_tasks=BATCH, lock_duration=60):
        for task in batch:
            await tasks.complete(task.id, task.lock_token, {"charge_id": f"ch-{task.id[:8]}"})
            answered += 1
    return answered
