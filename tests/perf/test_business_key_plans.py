"""A business key without a workflow: the instance list and counts find its instances directly.

The only index of business keys, instances_business_key, leads with (scope, definition_id): given a
business key alone (`stepstone list --business-key K`, GET /instances?business_key=K), the plan read the
whole of that index, or the newest-first walk of every instance, to find the few rows with that key.
Measured as the index and table pages the plan touches (EXPLAIN ANALYZE, BUFFERS), which a missing
index multiplies by the table's size and a direct lookup keeps to a handful.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from stepstone.bench.common import bench_queries, seed_waiting
from stepstone.bench.workflows import waiting
from stepstone.core.pin import pin_of
from stepstone.store.management import management_queries
from stepstone.store.queries import named_queries
from tests.perf.explained import explained, pages_of
from tests.perf.keyed_seed import seed_keyed

ROWS = 20_000


async def _pages(
    conn: asyncpg.Connection, plans: list[dict[str, Any]], query: str, *args: Any,
) -> tuple[int, list[str]]:
    """Pages the statements that read instances touched while `query` ran, and the indexes they used."""
    return await pages_of(conn, plans, "instances", query, *args)


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
        plans = await explained(conn)
        found = {name: await _pages(conn, plans, sql, *args) for name, (sql, *args) in cases.items()}
        assert all(any("business_key" in index for index in used) for _, used in found.values()), found
        [row] = await conn.fetch(q["instances_page"], None, None, None, key, None, None, 51, False)
        assert row["business_key"] == key
    finally:
        await conn.close()
    # A lookup: the index's few levels and the row's page (the counts: for each status branch, 11).
    assert {name: found[name] for name, (pages, _) in found.items() if pages > 60} == {}


async def test_a_business_key_is_looked_up_after_other_calls_of_the_statement(database_url: str) -> None:
    """A prepared statement (asyncpg's statement cache) takes its generic plan after five custom ones when
    that costs less than their average, and a generic plan cannot drop a `($n IS NULL OR col = $n)` filter
    nor use col's index for it. On one connection, after six lists or counts without a business key, a
    list or count by a business key must still be a lookup (docs/performance-history.md, "Listings on their custom
    plans"): the management API's counts read 2,209 pages for it on their generic plan."""
    conn = await asyncpg.connect(database_url)
    try:
        key = await seed_keyed(conn, ROWS)
    finally:
        await conn.close()
    q = management_queries("stepstone")
    ops = named_queries("operations.sql", "stepstone")
    client = named_queries("queries.sql", "stepstone")
    failed = [["FAILED"], *_filter(None)[1:]]
    cases = {  # (statement, arguments of the other calls, arguments with the key)
        "list": (q["instances_page"], [None, "FAILED", None, None, None, None, 51, False],
                 [None, None, None, key, None, None, 51, False]),
        "counts": (q["instance_counts"], [None, None, 10_000, False, None], [None, None, 10_000, False, key]),
        "stepstone list": (ops["find_instances"], [*failed, None, None, 51], [*_filter(key), None, None, 51]),
        "stepstone list, counts": (ops["count_instances"], failed, _filter(key)),
        "Client.list": (client["list_instances"], ["FAILED", None, None, None, None, 51, None, False],
                        [None, None, key, None, None, 51, None, False]),
    }
    found = {}
    for name, (sql, other, keyed) in cases.items():
        conn = await asyncpg.connect(database_url)
        try:
            plans = await explained(conn)
            for _ in range(6):
                await conn.fetch(sql, *other)
            found[name], _ = await _pages(conn, plans, sql, *keyed)
        finally:
            await conn.close()
    assert {name: pages for name, pages in found.items() if pages > 60} == {}
