"""A business key without a workflow: the instance list and counts find its instances directly.

The only index of business keys, instances_business_key, leads with (scope, definition_id): given a
business key alone (`stepstone list --business-key K`, GET /instances?business_key=K), the plan read the
whole of that index, or the newest-first walk of every instance, to find the few rows with that key.
Measured as the index and table pages the plan touches (EXPLAIN ANALYZE, BUFFERS), which a missing
index multiplies by the table's size and a direct lookup keeps to a handful.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import asyncpg

from stepstone.bench.common import bench_queries, seed_waiting
from stepstone.bench.workflows import waiting
from stepstone.core.pin import pin_of
from stepstone.store.management import management_queries
from stepstone.store.queries import named_queries

ROWS = 20_000


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


async def _pages(conn: asyncpg.Connection, query: str, *args: Any) -> tuple[int, list[str]]:
    """Pages the statement touched (shared hit or read, the plan's root counts its children's) and the
    indexes its scans of instances used."""
    raw = await conn.fetchval(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {query}", *args)
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    used = [n.get("Index Name") or n["Node Type"] for n in _nodes(plan) if n.get("Relation Name") == "instances"]
    return plan["Shared Hit Blocks"] + plan["Shared Read Blocks"], used


def _filter(key: str, scope: str | None = None) -> list[Any]:
    """operations.sql's instance_filter arguments: a business key (and a scope), nothing else."""
    return [None, None, None, scope, key, None, None, None, None, None, None, False]


async def test_a_business_key_alone_is_looked_up_not_scanned(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        await seed_waiting(conn, "stepstone", pin_of(waiting), 1, ROWS)
        # Tenants: 5,000 scopes of about four instances each, and a quarter in one large scope.
        await conn.execute("UPDATE stepstone.instances SET scope = CASE WHEN (hashtext(id::text) % 4) = 0 THEN 'acme'"
                           " ELSE 't' || abs(hashtext(id::text)) % 5000 END")
        await conn.execute("UPDATE stepstone.instances SET business_key = md5(id::text)")
        await conn.execute(bench_queries("stepstone")["analyze"])
        q = management_queries("stepstone")
        ops = named_queries("operations.sql", "stepstone")
        key = await conn.fetchval("SELECT business_key FROM stepstone.instances WHERE scope = 'acme' LIMIT 1")
        cases = {
            "list, every scope": (q["instances_page"], None, None, None, key, None, None, 51, False),
            "list, one scope": (q["instances_page"], ["acme"], None, None, key, None, None, 51, False),
            "list, archived too": (q["instances_page"], None, None, None, key, None, None, 51, True),
            "counts, every scope": (q["instance_counts"], None, None, 10_000, False, key),
            "counts, one scope": (q["instance_counts"], ["acme"], None, 10_000, False, key),
            "stepstone list": (ops["find_instances"], *_filter(key), None, None, 51),
            "stepstone list, one scope": (ops["find_instances"], *_filter(key, "acme"), None, None, 51),
            "stepstone list, counts": (ops["count_instances"], *_filter(key)),
        }
        found = {name: await _pages(conn, sql, *args) for name, (sql, *args) in cases.items()}
        [row] = await conn.fetch(q["instances_page"], None, None, None, key, None, None, 51, False)
        assert row["business_key"] == key
    finally:
        await conn.close()
    # A lookup: the index's few levels and the row's page (the counts: for each status branch, 11).
    assert {name: found[name] for name, (pages, _) in found.items() if pages > 60} == {}
