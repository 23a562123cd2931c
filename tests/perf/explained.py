"""The plans a statement ran on, nested ones too, with the pages they touched: auto_explain on one session.

A statement inside a plpgsql function is planned apart from the call, so EXPLAIN of the call shows a
Function Scan alone; auto_explain (log_nested_statements) reports the inner statement's plan as a NOTICE.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import asyncpg


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A plan node and every node below it."""
    yield plan
    for child in plan.get("Plans", []):
        yield from plan_nodes(child)


async def explained(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    """auto_explain on this session alone: every statement's plan (nested ones too) with its buffers, as a
    NOTICE the returned list collects."""
    plans: list[dict[str, Any]] = []

    def collect(_: object, message: asyncpg.PostgresLogMessage) -> None:
        if "plan:" in message.message:
            plans.append(json.loads(message.message.split("plan:", 1)[1]))

    conn.add_log_listener(collect)
    for setting in ("LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0", "SET auto_explain.log_analyze = on",
                    "SET auto_explain.log_buffers = on", "SET auto_explain.log_timing = off",
                    "SET auto_explain.log_nested_statements = on", "SET auto_explain.log_format = json",
                    "SET auto_explain.log_level = notice"):
        await conn.execute(setting)
    return plans


async def pages_of(
    conn: asyncpg.Connection, plans: list[dict[str, Any]], relation: str, query: str, *args: Any,
) -> tuple[int, list[str]]:
    """Pages the statements that read `relation` touched while `query` ran (shared hit or read, a plan's
    root counts its children's) and the indexes their scans of `relation` used (the node type for a scan
    of no index). `plans` is `explained`'s list for `conn`; a plan whose only reading of `relation` is a
    function's (a Function Scan) leaves the counting to the function's statement, and one that reads it
    itself counts (with what a function it calls read: an overcount, never a miss)."""
    plans.clear()
    await conn.fetch(query, *args)
    await conn.execute("SELECT 1")  # the NOTICEs of the call above have arrived
    reading = [p["Plan"] for p in plans
               if any(n.get("Relation Name") == relation for n in plan_nodes(p["Plan"]))]
    assert reading, f"no plan read {relation}: {query[:80]}"
    used = [n.get("Index Name") or n["Node Type"] for p in reading for n in plan_nodes(p)
            if n.get("Relation Name") == relation]
    return sum(p["Shared Hit Blocks"] + p["Shared Read Blocks"] for p in reading), used
