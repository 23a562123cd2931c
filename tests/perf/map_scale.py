"""Seconds a map of N instant items takes, start to end, on an in-process worker of 8 slots, of whichever
stepstone is importable, for interleaved A/B runs of two trees.

Not a test (pytest does not collect it): the harness behind "Joins take the queued reports" in
docs/performance-history.md. For each --items size it makes a fresh database on the server at --admin-url,
starts one `bench_fanout` instance mapping over that many items that return at once, and prints its
run time, items/s, and the most branch reports (BRANCH_DONE) that waited on the fork's position at
once (sampled every 0.2 s).

    python tests/perf/map_scale.py --items 250 1000 2000
"""

from __future__ import annotations

import argparse
import asyncio
import time

import asyncpg
from scratch_database import scratch_database  # a sibling: see scratch_database.py

from stepstone.bench.workflows import FanState, fanout, registry
from stepstone.client import Client
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.migrate import migrate
from stepstone.store.postgres import PostgresStore

SCHEMA = "stepstone"
QUEUED = ("SELECT count(*) FROM stepstone.commands WHERE instance_id = $1::uuid AND kind = 'BRANCH_DONE'"
          " AND state = 'PENDING'")


async def one_map(url: str, items: int) -> None:
    store = await PostgresStore.open(url, SCHEMA, max_size=12)
    worker = Worker(store, registry, WorkerConfig(concurrency=8, worker_id="map-scale"))
    await worker.start()
    conn = await asyncpg.connect(url)
    try:
        started = time.monotonic()
        instance_id = await Client(store, registry).start(fanout, FanState(items=[0.0] * items))
        queued = 0
        while (status := await conn.fetchval("SELECT status FROM stepstone.instances WHERE id = $1::uuid",
                                             instance_id)) not in ("COMPLETED", "FAILED"):
            queued = max(queued, int(await conn.fetchval(QUEUED, instance_id)))
            await asyncio.sleep(0.2)
        seconds = time.monotonic() - started
        print(f"{items:,} items: {status} in {seconds:.2f} s, {items / seconds:,.0f} items/s, "  # noqa: T201
              f"at most {queued:,} reports queued at once", flush=True)
    finally:
        await worker.stop()
        await store.close()
        await conn.close()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, nargs="+", default=[250, 1000, 2000])
    parser.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    for items in args.items:
        async with scratch_database(args.admin_url, "map") as url:
            conn = await asyncpg.connect(url)
            try:
                await migrate(conn, SCHEMA)
            finally:
                await conn.close()
            await one_map(url, items)


if __name__ == "__main__":
    asyncio.run(main())
