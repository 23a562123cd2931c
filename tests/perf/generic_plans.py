"""Which of the store's named queries would read a whole index of `commands` on their generic plan.

Not a test (pytest does not collect it): the audit behind docs/performance.md ("Lookups by id"). It
EXPLAINs the generic plan of every named query in the store's SQL files on the database at --url (analyze
it first; one analyzed while the queue was empty shows the plans a backlog would meet) and prints each
index scan on `commands` with no index condition, or whose only condition is on `id` in an index that
does not begin with it. Queries that are fragments of others (they do not parse alone) are skipped.

    python tests/perf/generic_plans.py --url postgresql://postgres@127.0.0.1:5432/mydb
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from typing import Any

import asyncpg

from stepstone.store.queries import named_queries

FILES = ("queries.sql", "caller_transaction.sql", "tasks.sql", "external.sql", "outbox.sql", "operations.sql",
         "management.sql", "schedules.sql", "health.sql", "observe.sql", "registry.sql")


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan."""
    yield plan
    for child in plan.get("Plans", []):
        yield from plan_nodes(child)


def reads_whole_index(node: dict[str, Any]) -> bool:
    """An index scan on `commands` that reads a whole index to find a few rows: no index condition, or a
    condition on `id` alone in an index that does not begin with it."""
    if node.get("Relation Name") != "commands" or "Index" not in node.get("Node Type", ""):
        return False
    cond = node.get("Index Cond")
    return cond is None or (cond.startswith("(id =") and node["Index Name"] != "commands_pkey")


async def _generic_plan(conn: asyncpg.Connection, sql: str) -> dict[str, Any] | None:
    try:
        parameters = len((await conn.prepare(sql)).get_parameters())
        await conn.execute(f"PREPARE audited AS {sql}")
    except asyncpg.PostgresError:
        return None  # a fragment of another query
    try:
        values = f"({', '.join(['NULL'] * parameters)})" if parameters else ""
        return json.loads(await conn.fetchval(f"EXPLAIN (FORMAT JSON) EXECUTE audited{values}"))[0]["Plan"]
    finally:
        await conn.execute("DEALLOCATE audited")


async def whole_index_reads(conn: asyncpg.Connection, schema: str) -> list[tuple[str, str, str]]:
    """(file, query, what it reads) for each generic-plan index scan on `commands` that reads a whole index:
    no index condition, or a condition on `id` alone in an index that does not begin with it."""
    found = []
    await conn.execute("SET plan_cache_mode = force_generic_plan")
    try:
        for filename in FILES:
            for name, sql in named_queries(filename, schema).items():
                plan = await _generic_plan(conn, sql)
                for node in plan_nodes(plan) if plan else ():
                    if reads_whole_index(node):
                        what = f"{node['Index Name']}, condition {node.get('Index Cond')}, filter {node.get('Filter')}"
                        found.append((filename, name, what))
    finally:
        await conn.execute("RESET plan_cache_mode")
    return found


async def main(url: str, schema: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        for filename, name, what in await whole_index_reads(conn, schema):
            print(f"{filename} {name}: {what}")  # noqa: T201
    finally:
        await conn.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="a database the engine's migrations have built")
    parser.add_argument("--schema", default="stepstone")
    args = parser.parse_args()
    asyncio.run(main(args.url, args.schema))
