"""What a worker's heartbeat costs the server with many waiting instances, with and without
`commands_not_runnable`.

Not a test (pytest does not collect it): the probe behind "Deferred commands, found by an index of their
own" in docs/performance-history.md. It makes a fresh database on the server at --admin-url, migrates it, seeds
--count waiting instances as `stepstone bench`'s scale workload does, and runs `EXPLAIN (ANALYZE,
BUFFERS)` of the heartbeat's look-up of commands deferred for want of a plan (registry.sql,
`resume_deferred`, with the bench registry's pins) five times with the index, and five times with it
dropped inside a transaction that is rolled back (the schema before migration 0033).

    python tests/perf/heartbeat_cost.py --count 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import json

import asyncpg
from scratch_database import scratch_database  # a sibling: see scratch_database.py

from stepstone.bench.scale import seed
from stepstone.bench.workflows import registry, waiting
from stepstone.core.pin import pin_of
from stepstone.store.migrate import migrate
from stepstone.store.queries import named_queries

SCHEMA = "stepstone"
CALLS = 5


async def measure(url: str, count: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        await migrate(conn, SCHEMA)
        await conn.execute("SET jit = off")  # as the store's sessions run
        await seed(conn, SCHEMA, pin_of(waiting), 1, count)
        sql = named_queries("registry.sql", SCHEMA)["resume_deferred"]
        pins = [pin_of(wf) for wf in registry]
        args = ([p.definition_id for p in pins], [p.version for p in pins], [p.plan_hash for p in pins])
        for label, drop in (("with commands_not_runnable", False), ("without it (before migration 0033)", True)):
            runs = []
            for _ in range(CALLS):
                tr = conn.transaction()
                await tr.start()
                try:
                    if drop:
                        await conn.execute(f"DROP INDEX {SCHEMA}.commands_not_runnable")
                    plan = json.loads(await conn.fetchval("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, *args))[0]
                finally:
                    await tr.rollback()
                top = plan["Plan"]
                buffers = top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0)
                runs.append((plan["Execution Time"], buffers))
            times = ", ".join(f"{ms:.2f}" for ms, _ in runs)
            print(f"{count:,} waiting, {label}: {times} ms a call, {runs[-1][1]:,} buffers")  # noqa: T201
    finally:
        await conn.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200_000, help="waiting instances seeded")
    parser.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    async with scratch_database(args.admin_url, "stepstone_heartbeat") as url:
        await measure(url, args.count)


if __name__ == "__main__":
    asyncio.run(main())
