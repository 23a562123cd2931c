"""Bytes on disk per waiting instance, by relation, of whichever stepstone is importable.

Not a test (pytest does not collect it): the harness behind "Waiting rows fill more of their pages" in
docs/performance-history.md. It makes a fresh database on the server at --admin-url, migrates it, runs --setup
(SQL, e.g. `ALTER TABLE stepstone.instances SET (fillfactor = 70)` to measure another layout on the same
code), seeds 1,000 waiting instances as `stepstone bench`'s scale workload does (`seed_waiting`), then
--count more, and prints each relation's growth per instance (heap, TOAST and every index), largest
first. Unlike the bench, nothing runs between the two seeds, so every index grows at its right edge.

    python tests/perf/waiting_bytes.py --count 100000
"""

from __future__ import annotations

import argparse
import asyncio

import asyncpg
from scratch_database import scratch_database  # a sibling: see scratch_database.py

from stepstone.bench.common import seed_waiting
from stepstone.bench.workflows import waiting
from stepstone.core.pin import pin_of
from stepstone.store.migrate import migrate

SCHEMA = "stepstone"
FIRST = 1_000
BATCH = 200_000

SIZES = """
SELECT c.relname AS relation, COALESCE(t.relname, c.relname) AS tbl, pg_relation_size(c.oid) AS bytes
FROM pg_class c
LEFT JOIN pg_index i ON i.indexrelid = c.oid
LEFT JOIN pg_class t ON t.oid = i.indrelid
WHERE c.relnamespace = $1::regnamespace AND c.relkind IN ('r', 'i')
UNION ALL
SELECT 'toast of ' || c.relname, c.relname, pg_total_relation_size(c.reltoastrelid)
FROM pg_class c WHERE c.relnamespace = $1::regnamespace AND c.relkind = 'r' AND c.reltoastrelid <> 0
"""


async def sizes(conn: asyncpg.Connection) -> dict[tuple[str, str], int]:
    return {(r["relation"], r["tbl"]): r["bytes"] for r in await conn.fetch(SIZES, SCHEMA)}


async def measure(url: str, count: int, setup: str | None) -> None:
    conn = await asyncpg.connect(url)
    try:
        await migrate(conn, SCHEMA)
        if setup:
            await conn.execute(setup)
        pin = pin_of(waiting)
        await seed_waiting(conn, SCHEMA, pin, 1, FIRST)
        before = await sizes(conn)
        for lo in range(FIRST + 1, FIRST + count + 1, BATCH):
            async with conn.transaction():
                await seed_waiting(conn, SCHEMA, pin, lo, min(FIRST + count, lo + BATCH - 1))
        after = await sizes(conn)
    finally:
        await conn.close()
    grown = sorted(((key, (size - before.get(key, 0)) / count) for key, size in after.items()), key=lambda kv: -kv[1])
    for (relation, table), per in grown:
        if per >= 0.5:
            print(f"  {relation:40} {'' if relation == table else table:12} {per:8.1f}")  # noqa: T201
    print(f"  {'total':53} {sum(per for _, per in grown):8.1f} bytes per waiting instance")  # noqa: T201


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100_000, help="waiting instances measured")
    parser.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--setup", help="SQL run after migrating, before seeding")
    args = parser.parse_args()
    async with scratch_database(args.admin_url, "stepstone_bytes") as url:
        await measure(url, args.count, args.setup)


if __name__ == "__main__":
    asyncio.run(main())
