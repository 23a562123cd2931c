"""Which of the store's named queries would read a whole index of `commands` on their generic plan.

Not a test (pytest does not collect it): the audit behind docs/performance-history.md ("Lookups by id"). It
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
import re
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


def scans_over(plan: dict[str, Any], relation: str, rows: int) -> set[str]:
    """The scans of `relation` in an EXPLAIN ANALYZE plan that touched more than `rows` rows in all (rows
    returned and filtered out, times loops), each described by its index (or node type) and counts."""
    return {
        f"{node.get('Index Name', node['Node Type'])}: {node['Actual Rows']} rows"
        f" + {node.get('Rows Removed by Filter', 0)} filtered, {node['Actual Loops']} loops"
        for node in plan_nodes(plan)
        if node.get("Relation Name") == relation
        and (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * node["Actual Loops"] > rows
    }


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


async def function_statement(conn: asyncpg.Connection, function: str, schema: str = "stepstone") -> str:
    """The statement a plpgsql function runs as its RETURN QUERY, its arguments made the parameters $1..$n
    (each cast to the argument's type), so that PREPARE and EXPLAIN show that statement's own plan: the
    claim's statement is the body of `claim_heads` (migration 0036)."""
    row = await conn.fetchrow(
        "SELECT p.prosrc, p.proargnames[1:p.pronargs] AS names,"
        " ARRAY(SELECT format_type(t.oid, NULL) FROM unnest(p.proargtypes) WITH ORDINALITY AS t(oid, n)"
        " ORDER BY t.n) AS types"
        " FROM pg_proc p WHERE p.proname = $1 AND p.pronamespace = $2::regnamespace", function, schema)
    assert row is not None, f"no function {schema}.{function}"
    statement = row["prosrc"].split("RETURN QUERY", 1)[1].rsplit(";", 1)[0]
    for n, (name, type_) in enumerate(zip(row["names"], row["types"], strict=True), start=1):
        statement = re.sub(rf"\b{name}\b", f"${n}::{type_}", statement)
    return statement


STATEMENT_FUNCTIONS = ("claim_heads", "stranded")
"""Functions whose body is the one statement a named query runs (queries.sql, `claim`; registry.sql,
`stranded`, migration 0066), audited as that statement."""


async def whole_index_reads(conn: asyncpg.Connection, schema: str) -> list[tuple[str, str, str]]:
    """(file, query, what it reads) for each generic-plan index scan on `commands` that reads a whole index:
    no index condition, or a condition on `id` alone in an index that does not begin with it. The statements
    of STATEMENT_FUNCTIONS are audited as ("functions", <name>)."""
    found = []
    audited = [(filename, named_queries(filename, schema)) for filename in FILES]
    audited.append(("functions", {f: await function_statement(conn, f, schema) for f in STATEMENT_FUNCTIONS}))
    await conn.execute("SET plan_cache_mode = force_generic_plan")
    try:
        for filename, named in audited:
            for name, sql in named.items():
                plan = await _generic_plan(conn, sql)
                if plan is None and filename == "functions":
                    raise AssertionError(f"the statement of {name} does not prepare alone: {sql[:200]}")
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
