"""Rows of waiting instances fill more of their heap pages (migration 0031).

A waiting instance can wait for months, and every byte of slack on its pages is paid for that long.
Instances and positions keep a fifth of each page free, which still holds one more version of any row
kept in line, so an update stays HOT (docs/performance-history.md, "Waiting rows fill more of their pages"); a
fuller page would not (at fillfactor 90, with a 1.5 KB state, almost no instance update was HOT).
"""

from __future__ import annotations

import asyncpg

from stepstone.testing import Engine
from tests.engine import workflows

STARTED = 2_000

# Of each heap page that holds rows, the share its tuples take (header, data and alignment, and their line
# pointers). Pages that hold none are left out: two inserters contending for the relation's extension lock
# make PostgreSQL add up to 20 empty pages per waiter at once, which says nothing about the fillfactor.
FILL = """
SELECT sum(((pg_column_size(t.*) + 7) / 8) * 8 + 4)::float8
       / (count(DISTINCT (t.ctid::text::point)[0]) * current_setting('block_size')::int)
FROM stepstone.{table} t
"""


async def test_started_instances_and_their_positions_fill_four_fifths_of_their_pages(engine: Engine,
                                                                                   database_url: str) -> None:
    # One batch: one inserter, so every page but the last is filled up to the fillfactor.
    await engine.client.start_many(workflows.waiter, [{"order_id": f"o-{n}"} for n in range(STARTED)],
                                   batch_size=STARTED)
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM stepstone.positions") == STARTED
        instances = await conn.fetchval(FILL.format(table="instances"))
        positions = await conn.fetchval(FILL.format(table="positions"))
    finally:
        await conn.close()
    # At fillfactor 70 both were about 0.68 (30% of each page kept free, plus the last row that did not fit);
    # fuller than 0.8, a page would not hold one more version of a row of 1.5-2 KB.
    for table, fill in (("instances", instances), ("positions", positions)):
        assert 0.75 <= fill <= 0.8, f"{table} fill {fill:.0%} of their pages"
