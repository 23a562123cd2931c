"""Retention throughput: instances archived and purged per second, in bounded batches.

    python -m stepstone.bench.retention --admin-url postgresql://postgres@127.0.0.1:5432/postgres

Seeds completed instances as the engine leaves them (instance, root position, two commands, three
history entries each) in a fresh database, moves the database clock past the 30-day window, and
times one sweep that archives them and, a day later, one that purges them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import asyncpg

from stepstone.bench.common import BenchContext, Sizes, bench_database, seed_waiting
from stepstone.ops import Operations
from stepstone.store.factory import open_store
from stepstone.store.port import Pin
from stepstone.store.queries import named_queries

__all__ = ["measure"]

DAY = 86_400.0


async def measure(url: str, schema: str, instances: int, batch_size: int) -> dict[str, Any]:
    """Seed `instances` completed instances and time their archive and their purge."""
    q = named_queries("bench_retention.sql", schema)
    conn = await asyncpg.connect(url)
    try:
        pin = Pin("default", "bench_retention", 1, "0" * 64)
        for first in range(1, instances + 1, 10_000):
            last = min(first + 9_999, instances)
            await seed_waiting(conn, schema, pin, first, last)
            await conn.execute(q["complete_seeded"], first, last)
        await conn.execute(q["analyze"])
    finally:
        await conn.close()
    store = await open_store(url, schema)
    try:
        ops = Operations.on(store)
        await store.move_clock(31 * DAY)
        started = time.perf_counter()
        archived = await ops.retention_run(batch_size=batch_size)
        archive_s = time.perf_counter() - started
        await store.move_clock(DAY + 60)
        started = time.perf_counter()
        purged = await ops.retention_run(batch_size=batch_size)
        purge_s = time.perf_counter() - started
    finally:
        await store.close()
    return {
        "instances": instances, "batch_size": batch_size,
        "archived": archived.archived, "archive_seconds": round(archive_s, 3),
        "archived_per_second": round(archived.archived / archive_s),
        "purged": purged.purged, "purge_seconds": round(purge_s, 3),
        "purged_per_second": round(purged.purged / purge_s),
    }


async def _main(args: argparse.Namespace) -> None:
    sizes = Sizes("retention", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    ctx = BenchContext(args.admin_url, args.schema, sizes, 1, 1, "")
    for batch_size in args.batch_size:
        async with bench_database(ctx) as url:
            result = await measure(url, args.schema, args.instances, batch_size)
        print(json.dumps(result), flush=True)  # noqa: T201 - the benchmark's output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--admin-url", required=True, help="A role that may create databases.")
    parser.add_argument("--schema", default="stepstone")
    parser.add_argument("--instances", type=int, default=20_000)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[500, 2000])
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
