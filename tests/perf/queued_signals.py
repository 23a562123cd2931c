"""Bursts of signals queued on a few instances, and one-step workflows started behind them.

Not a test (pytest does not collect it): the harness behind "Signals queued behind another" in
docs/performance-history.md. With no worker running, `--hot` instances of a workflow that waits for `tick` again
and again each get `--signals` signals, then `--plain` one-step workflows are started; then an in-process
worker of 8 slots starts and the script prints how long until every one-step workflow completed and until
every signal was applied. `--hot 5 --signals 1000` is a burst on a few instances; `--hot 1000 --signals 5`
the same number of signals spread out.

    python tests/perf/queued_signals.py --hot 5 --signals 1000 --plain 2000
"""

from __future__ import annotations

import argparse
import asyncio
import time
from datetime import timedelta

import asyncpg
from pydantic import BaseModel
from scratch_database import scratch_database  # a sibling: see scratch_database.py

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.client import Client
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.migrate import migrate
from stepstone.store.postgres import PostgresStore

SCHEMA = "stepstone"


class Tally(BaseModel):
    n: int = 0
    goal: int = 0


hot = Workflow("queued_hot", version=1, state=Tally)


@hot.step(start=True, next="w")
async def begin(_ctx: StepContext, _state: Tally) -> None:
    return None


hot.wait("w", signals={"tick": "count"}, timeout=timedelta(hours=1), on_timeout="done")


@hot.step(next=["w", "done"])
async def count(_ctx: StepContext, state: Tally) -> str:
    state.n += 1
    return "w" if state.n < state.goal else "done"


@hot.step(next=None)
async def done(_ctx: StepContext, _state: Tally) -> None:
    return None


plain = Workflow("queued_plain", version=1, state=Tally)


@plain.step(start=True, next=None)
async def only(_ctx: StepContext, _state: Tally) -> None:
    return None


registry = Registry(hot, plain)


async def measure(url: str, hot_count: int, signals: int, plain_count: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        await migrate(conn, SCHEMA)
    finally:
        await conn.close()
    client_store = await PostgresStore.open(url, SCHEMA, max_size=4)
    worker_store = await PostgresStore.open(url, SCHEMA, max_size=12)
    try:
        client = Client(client_store, registry)
        hots = [await client.start(hot, Tally(goal=signals)) for _ in range(hot_count)]
        for iid in hots:
            for k in range(signals):
                await client.signal(iid, "tick", {"k": k})
        plains = [await client.start(plain, Tally()) for _ in range(plain_count)]
        began = time.monotonic()
        worker = Worker(worker_store, registry, WorkerConfig(concurrency=8, worker_id="queued"))
        await worker.start()
        try:
            for iid in plains:
                await client.wait_for(iid, timeout=600)
            plain_done = time.monotonic() - began
            for iid in hots:
                await client.wait_for(iid, timeout=600)
            all_done = time.monotonic() - began
        finally:
            await worker.stop()
    finally:
        await worker_store.close()
        await client_store.close()
    print(f"{hot_count} x {signals} signals, {plain_count} one-step workflows behind them: "  # noqa: T201
          f"those done in {plain_done:.2f} s, every signal applied in {all_done:.2f} s")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hot", type=int, default=5)
    parser.add_argument("--signals", type=int, default=1000)
    parser.add_argument("--plain", type=int, default=2000)
    parser.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    async with scratch_database(args.admin_url, "stepstone_queued") as url:
        await measure(url, args.hot, args.signals, args.plain)


if __name__ == "__main__":
    asyncio.run(main())
