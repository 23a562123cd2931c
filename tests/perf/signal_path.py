"""Where an idle signal's time goes before its next step starts: a breakdown of the latency workload's
"signal -> next step, idle" figure (issue 17's p99 <= 3 ms target).

Not a test (pytest does not collect it): a diagnostic behind docs/performance-history.md. On a fresh database at
--admin-url, with an in-process worker of 8 slots, it starts one `bench_signal` instance at a time, waits
until it waits, sends its signal and records, on this process's monotonic clock from the send:

    signal sent     the client's signal returned (its command committed)
    notified        the worker's wake-up notification arrived
    claim sent      the claim statement that took the signal went out
    claim back      that claim returned
    transition      the worker began the step after the signal's own commit (the signal is applied to the
                    wait and committed first; the step runs as that commit's continuation)
    step            the step's handler started (what the latency workload reports)

It wraps the worker's internals (its claim, its wake-up callback and its decide-and-commit) to read
the clock, so it follows their names.

    python tests/perf/signal_path.py --samples 300
    python tests/perf/signal_path.py --samples 300 --waiting 100000

With --waiting, that many waiting instances are seeded (as the scale bench seeds them) and analyzed
after the worker has started and claimed on the empty database: the worker's connections then claim
on tables that grew after their first claims ("The claim on its generic plan" in docs/performance-history.md).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import asyncpg
from scratch_database import scratch_database  # a sibling: see scratch_database.py

from stepstone.bench.common import Progress, track_commits
from stepstone.bench.scale import seed
from stepstone.bench.workflows import SIGNAL_SEEN, registry, signal_wf, waiting
from stepstone.client import Client
from stepstone.core.pin import pin_of
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.migrate import migrate
from stepstone.store.postgres import PostgresStore

SCHEMA = "stepstone"
MARKS = ("signal sent", "notified", "claim sent", "claim back", "transition", "step")


def _instrument(worker: Worker, store: PostgresStore) -> tuple[list[float], dict[str, dict[str, float]]]:
    """Wrap the worker's wake-up, claim and decide-and-commit; returns the notification times and, per
    instance, when its last claim went out and came back and when its last decide-and-commit began."""
    notified: list[float] = []
    seen: dict[str, dict[str, float]] = {}
    on_due, claim, decide = worker._on_due, store.claim, worker._decide_and_commit

    def timed_on_due(due_in: float, definition: str | None = None) -> None:
        notified.append(time.monotonic())
        on_due(due_in, definition)

    async def timed_claim(*args: Any) -> Any:
        sent = time.monotonic()
        claims = await claim(*args)
        for c in claims:
            seen[c.instance.id] = {"claim sent": sent, "claim back": time.monotonic()}
        return claims

    async def timed_decide(c: Any, *args: Any) -> Any:
        seen.setdefault(c.instance.id, {})["transition"] = time.monotonic()
        return await decide(c, *args)

    worker._on_due = timed_on_due  # type: ignore[method-assign]
    store.claim = timed_claim  # type: ignore[method-assign]
    worker._decide_and_commit = timed_decide  # type: ignore[method-assign]
    return notified, seen


async def _grow(url: str, size: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        await seed(conn, SCHEMA, pin_of(waiting), 1, size)  # and analyzed, as the scale bench does
    finally:
        await conn.close()


async def main(admin_url: str, samples: int, min_wake: float, grown: int) -> None:
    async with scratch_database(admin_url, "signal_path") as url:
        conn = await asyncpg.connect(url)
        await migrate(conn, SCHEMA)
        await conn.close()
        worker_store = await PostgresStore.open(url, SCHEMA, max_size=12)
        client_store = await PostgresStore.open(url, SCHEMA, max_size=4)
        progress = Progress()
        track_commits(worker_store, progress)
        client = Client(client_store, registry)
        worker = Worker(worker_store, registry, WorkerConfig(concurrency=8, worker_id="signal-path",
                                                                  min_wake_interval=min_wake))
        notified, seen = _instrument(worker, worker_store)
        await worker.start()
        rows: list[dict[str, float]] = []
        try:
            if grown:
                for _ in range(10):  # the worker's claims on the empty database
                    iid = await client.start(signal_wf, {})
                    await progress.wait_until(lambda iid=iid: iid in progress.waiting, timeout=60)
                    await client.signal(iid, "go")
                    await progress.wait_until(lambda iid=iid: iid in progress.ended, timeout=60)
                    SIGNAL_SEEN.pop(iid, None)
                await _grow(url, grown)
            for _ in range(samples):
                iid = await client.start(signal_wf, {})
                await progress.wait_until(lambda iid=iid: iid in progress.waiting, timeout=60)
                notified.clear()
                sent = time.monotonic()
                await client.signal(iid, "go")
                returned = time.monotonic()
                await progress.wait_until(lambda iid=iid: iid in progress.ended, timeout=60)
                marks = seen.pop(iid)
                first = next((t for t in notified if t >= sent), float("nan"))
                rows.append({"signal sent": returned, "notified": first, **marks, "step": SIGNAL_SEEN.pop(iid)}
                            | {"origin": sent})
        finally:
            await worker.stop()
            await client_store.close()
            await worker_store.close()
    print(f"{samples} idle signals, ms from the send:")  # noqa: T201
    for mark in MARKS:
        xs = sorted((r[mark] - r["origin"]) * 1000 for r in rows)
        print(f"  {mark:12s} p50 {xs[len(xs) // 2]:6.2f}  p90 {xs[int(len(xs) * 0.9)]:6.2f}  "  # noqa: T201
              f"p99 {xs[min(len(xs) - 1, int(len(xs) * 0.99))]:6.2f}")
    _tail(rows)


def _tail(rows: list[dict[str, float]]) -> None:
    """Where the slowest twentieth spent its time: the mean gap before each mark, beside the median's."""
    rows = sorted(rows, key=lambda r: r["step"] - r["origin"])
    slow = rows[int(len(rows) * 0.95):]
    print(f"gap before each mark, ms: median signal / mean of the slowest {len(slow)}:")  # noqa: T201
    previous = "origin"
    for mark in MARKS:
        gaps = sorted((r[mark] - r[previous]) * 1000 for r in rows)
        slow_gap = sum((r[mark] - r[previous]) * 1000 for r in slow) / len(slow)
        print(f"  {mark:12s} {gaps[len(gaps) // 2]:6.2f} / {slow_gap:6.2f}")  # noqa: T201
        previous = mark if mark != "signal sent" else "origin"  # the client's return is beside, not before


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--min-wake", type=float, default=WorkerConfig.min_wake_interval,
                        help="the worker's min_wake_interval (coalescing of wake-ups after an empty claim)")
    parser.add_argument("--waiting", type=int, default=0,
                        help="waiting instances seeded and analyzed after the worker's first claims")
    args = parser.parse_args()
    asyncio.run(main(args.admin_url, args.samples, args.min_wake, args.waiting))
