"""The operators' instance lists and counts by a business key and by a status, on one connection after
calls of the same statement without them (docs/performance-history.md, "Listings on their custom plans").

Seeds --count waiting instances (each with a business key, 1% FAILED) in a fresh database, then for each
case opens a connection, runs the statement six times with other arguments (the counts or list of every
instance, which a prepared statement's plan choice averages over), and times --calls calls with the key
or the status: p50 and max in ms. Measures whichever stepstone is importable (PYTHONPATH=<tree>/src).

    python tests/perf/listing_plans.py --count 100000 --admin-url postgresql://postgres@127.0.0.1:5432/postgres
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import asyncpg
from keyed_seed import seed_keyed  # siblings
from scratch_database import scratch_database  # see scratch_database.py

from stepstone.store.management import management_queries
from stepstone.store.migrate import migrate
from stepstone.store.queries import named_queries


def _filter(key: str | None = None, statuses: list[str] | None = None) -> list[Any]:
    return [statuses, None, None, None, key, None, None, None, None, None, None, False]


async def measure(url: str, count: int, calls: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        await migrate(conn, "stepstone")
        key = await seed_keyed(conn, count)
    finally:
        await conn.close()
    q = management_queries("stepstone")
    ops = named_queries("operations.sql", "stepstone")
    every = [None, None, 10_000, False, None]
    cases = {  # name: (statement, the other calls' arguments, the timed calls' arguments)
        "API counts by business key": (q["instance_counts"], every, [None, None, 10_000, False, key]),
        "API list by business key": (q["instances_page"], [None, None, None, None, None, None, 51, False],
                                     [None, None, None, key, None, None, 51, False]),
        "API list by status FAILED": (q["instances_page"], [None, None, None, None, None, None, 51, False],
                                      [None, "FAILED", None, None, None, None, 51, False]),
        "stepstone list by business key": (ops["find_instances"], [*_filter(), None, None, 51],
                                           [*_filter(key), None, None, 51]),
        "stepstone list counts by business key": (ops["count_instances"], _filter(), _filter(key)),
        "stepstone list counts by status FAILED": (ops["count_instances"], _filter(), _filter(None, ["FAILED"])),
    }
    for name, (sql, other, timed) in cases.items():
        conn = await asyncpg.connect(url)
        try:
            for _ in range(6):
                await conn.fetch(sql, *other)
            took = []
            for _ in range(calls):
                start = time.perf_counter()
                await conn.fetch(sql, *timed)
                took.append((time.perf_counter() - start) * 1000)
        finally:
            await conn.close()
        print(f"{name}: p50 {statistics.median(took):.2f} ms, max {max(took):.2f} ms")  # noqa: T201


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    async with scratch_database(args.admin_url, "listing_plans") as url:
        await measure(url, args.count, args.calls)


if __name__ == "__main__":
    asyncio.run(main())
