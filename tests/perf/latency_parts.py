"""Where a workflow's time goes in the latency workload's open loop, of whichever stepstone is importable.

Not a test (pytest does not collect it): the probe behind "Not done yet", item 6, in docs/performance-history.md.
It makes a fresh database on the server at --admin-url, runs one in-process worker of 8 slots, starts
three-step workflows on a fixed timetable at --rate for --seconds (at most 16 starts in flight, as the
bench's open loop), and prints for the median, p90 and p99 workflow the parts of its time: waiting for
a start slot, the start's round trip, and from the start's return to the commit that ended it; the
collections of Python's garbage collector during the run; and the worker's ANALYZEs of its young tables
(`refresh_statistics`), each a burst of server work that slow workflows cluster around. `--freeze`
freezes the objects alive after the warm-up (`gc.freeze()`), which takes the full collections' pause
away (an experiment: docs/performance-history.md, "Documents without statistics").

    python tests/perf/latency_parts.py --rate 480 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from typing import Any

import asyncpg
from scratch_database import scratch_database  # a sibling: see scratch_database.py

from stepstone.bench.common import Progress, track_commits
from stepstone.bench.workflows import registry, three
from stepstone.client import Client
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.factory import open_store
from stepstone.store.migrate import migrate
from stepstone.store.postgres import PostgresStore

SCHEMA = "stepstone"
IN_FLIGHT = 16
WARM_UP = 200


class Collections:
    """The garbage collector's pauses (ms) by generation, from its callbacks."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._began = 0.0
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses.append((info["generation"], (time.perf_counter() - self._began) * 1e3))

    def report(self) -> None:
        gc.callbacks.remove(self._note)
        for generation in (0, 1, 2):
            pauses = sorted(p for g, p in self.pauses if g == generation)
            if pauses:
                print(f"gc generation {generation}: {len(pauses)} collections, {sum(pauses):.0f} ms in all, "  # noqa: T201
                      f"longest {pauses[-1]:.1f} ms")


async def measure(url: str, rate: float, seconds: float, freeze: bool) -> None:
    conn = await asyncpg.connect(url)
    await migrate(conn, SCHEMA)
    progress = Progress()
    worker_store = await PostgresStore.open(url, SCHEMA, max_size=12)
    client_store = await open_store(url, SCHEMA, max_size=IN_FLIGHT)
    track_commits(worker_store, progress)
    analyses: list[tuple[float, float]] = []  # (began, ms) of each refresh that ran ANALYZE
    refresh = worker_store.refresh_statistics

    async def timed_refresh(*args: Any, **kwargs: Any) -> bool:
        began = time.monotonic()
        done = await refresh(*args, **kwargs)
        if time.monotonic() - began > 0.005:  # a look that found nothing due takes about a millisecond
            analyses.append((began, (time.monotonic() - began) * 1e3))
        return done

    worker_store.refresh_statistics = timed_refresh  # type: ignore[method-assign]
    client = Client(client_store, registry)
    worker = Worker(worker_store, registry, WorkerConfig(concurrency=8, worker_id="latency-parts"))
    await worker.start()
    try:
        warm = [await client.start(three, {}) for _ in range(WARM_UP)]
        await progress.wait_until(lambda: all(i in progress.ended for i in warm), timeout=120)
        await conn.execute("ANALYZE")
        if freeze:
            gc.collect()
            gc.freeze()
        slots = asyncio.Semaphore(IN_FLIGHT)
        times: dict[str, tuple[float, float, float]] = {}  # id -> (scheduled, start sent, start returned)

        async def start(at: float) -> None:
            async with slots:
                sent = time.monotonic()
                instance_id = await client.start(three, {})
                times[instance_id] = (at, sent, time.monotonic())

        collections = Collections()
        tasks = []
        origin = time.monotonic()
        for i in range(int(rate * seconds)):
            at = origin + i / rate
            if (delay := at - time.monotonic()) > 0:
                await asyncio.sleep(delay)  # the timetable of the open loop
            tasks.append(asyncio.create_task(start(at)))
        await asyncio.gather(*tasks)
        await progress.wait_until(lambda: all(i in progress.ended for i in times), timeout=120)
        collections.report()
    finally:
        await worker.stop()
        await client_store.close()
        await worker_store.close()
        await conn.close()
    parts = sorted((progress.ended[i] - at, sent - at, back - sent, progress.ended[i] - back)
                   for i, (at, sent, back) in times.items())
    n = len(parts)
    print(f"{n} workflows at {rate:g}/s")  # noqa: T201
    print("worker's ANALYZEs (s into the run, ms):",  # noqa: T201
          ", ".join(f"{began - origin:.1f} s {ms:.0f} ms" for began, ms in analyses if began >= origin) or "none")
    for q in (50, 90, 99):
        total, slot, trip, run = parts[min(n - 1, n * q // 100)]
        print(f"p{q}: {total * 1e3:.1f} ms = a start slot {slot * 1e3:.1f} + the start {trip * 1e3:.1f} "  # noqa: T201
              f"+ start -> end {run * 1e3:.1f}")
    for k, label in ((1, "a start slot"), (2, "the start's round trip"), (3, "start -> end")):
        values = sorted(p[k] * 1e3 for p in parts)
        print(f"  {label}: p50 {values[n // 2]:.1f} p90 {values[n * 9 // 10]:.1f} "  # noqa: T201
              f"p99 {values[n * 99 // 100]:.1f} max {values[-1]:.1f} ms")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=480.0, help="workflows started a second")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--freeze", action="store_true", help="freeze the objects alive after the warm-up")
    parser.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    async with scratch_database(args.admin_url, "stepstone_parts") as url:
        await measure(url, args.rate, args.seconds, args.freeze)


if __name__ == "__main__":
    asyncio.run(main())
