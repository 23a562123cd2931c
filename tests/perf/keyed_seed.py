"""Waiting instances for the listing measurements: each with a business key, 1% FAILED, analyzed.

Used by tests/perf/test_business_key_plans.py and tests/perf/listing_plans.py (run as a script, with this
folder on its path)."""

from __future__ import annotations

import asyncpg

from stepstone.bench.common import bench_queries, seed_waiting
from stepstone.bench.workflows import waiting
from stepstone.core.pin import pin_of


async def seed_keyed(conn: asyncpg.Connection, count: int) -> str:
    """`count` waiting instances keyed by md5 of their id, one in a hundred FAILED; one of their keys."""
    await seed_waiting(conn, "stepstone", pin_of(waiting), 1, count)
    await conn.execute("UPDATE stepstone.instances SET business_key = md5(id::text)")
    await conn.execute("UPDATE stepstone.instances SET status = 'FAILED' WHERE (hashtext(id::text) % 100) = 0")
    await conn.execute(bench_queries("stepstone")["analyze"])
    return str(await conn.fetchval("SELECT business_key FROM stepstone.instances LIMIT 1"))
