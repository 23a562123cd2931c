"""Rows of waiting instances fill their heap pages (migration 0031).

A waiting instance can wait for months, and every byte of slack on its pages is paid for that long. An
instance's status changes are never HOT (instances_status_created reads status) and its other updates
were HOT as often at fillfactor 100 as at 70, so its rows fill their pages; a position's updates touch no
indexed column and keep a tenth of the page for them (docs/performance.md, "Waiting rows fill their
pages").
"""

from __future__ import annotations

import asyncpg

from stepstone.testing import Engine
from tests.engine import workflows

STARTED = 2_000

# Of each heap page, the share its tuples take (header, data and alignment, and their line pointers).
FILL = """
SELECT sum(((pg_column_size(t.*) + 7) / 8) * 8 + 4)::float8 / pg_relation_size('stepstone.{table}')
FROM stepstone.{table} t
"""


async def test_started_instances_and_their_positions_fill_their_pages(engine: Engine, database_url: str) -> None:
    await engine.client.start_many(workflows.waiter, [{"order_id": f"o-{n}"} for n in range(STARTED)])
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM stepstone.positions") == STARTED
        instances = await conn.fetchval(FILL.format(table="instances"))
        positions = await conn.fetchval(FILL.format(table="positions"))
    finally:
        await conn.close()
    # At fillfactor 70 both were about 0.68 (30% of each page kept free, plus the last row that did not fit).
    assert instances >= 0.9, f"instances fill {instances:.0%} of their pages"
    assert 0.8 <= positions < 0.95, f"positions fill {positions:.0%} of their pages"
