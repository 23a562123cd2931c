"""A fresh database's tables get statistics once they have grown, without waiting for autovacuum.

Until a table is analyzed the planner takes it for nearly empty, and the claim's cached plan read and
sorted the whole backlog for every batch it took.
"""

from __future__ import annotations

import asyncio

import asyncpg

from stepstone.testing import Engine
from tests.engine import workflows

HOT = ("instances", "positions", "commands", "history")


async def _analyzed(conn: asyncpg.Connection) -> dict[str, bool]:
    rows = await conn.fetch(
        "SELECT relname, last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL AS done FROM pg_stat_user_tables "
        "WHERE schemaname = 'stepstone' AND relname = ANY($1::text[])", list(HOT))
    return {r["relname"]: r["done"] for r in rows}


async def test_small_tables_are_left_to_autovacuum_and_grown_ones_are_analyzed(engine: Engine,
                                                                               database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        assert not any((await _analyzed(conn)).values())
        assert await engine.store.refresh_statistics() is False  # nothing big enough yet: look again later
        assert not any((await _analyzed(conn)).values())

        await engine.client.start_many(workflows.waiter, [{"order_id": f"o-{n}"} for n in range(1_200)])
        # The row counts reach pg_stat_user_tables when the inserting backends flush their statistics
        # (at most every second while busy, within ten seconds when idle): look until they have.
        deadline = asyncio.get_running_loop().time() + 30
        while not await engine.store.refresh_statistics():
            assert asyncio.get_running_loop().time() < deadline, "the grown tables were never analyzed"
            await asyncio.sleep(0.2)
        assert await _analyzed(conn) == dict.fromkeys(HOT, True)
        assert await engine.store.refresh_statistics() is True  # and nothing more to do
    finally:
        await conn.close()
