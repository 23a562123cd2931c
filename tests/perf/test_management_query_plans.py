"""EXPLAIN guards of the management API's queries: the instance list (per scope, per status, all),
one instance's history, commands and outbox events, and the dead letters use indexes, never a Seq
Scan on instances, commands, history or outbox, with enough rows that a missing index would show.
(The per-status counts stop at 10,001 rows of a status: a common status is read by a scan that stops
there, by design, so they are measured in the api bench rather than guarded here; except the counts of
a business key, which few instances match, so a scan would not stop early: those are guarded.)"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import asyncpg

from stepstone.bench.common import bench_queries, seed_waiting
from stepstone.bench.workflows import waiting
from stepstone.core.model import FAILURE_KINDS
from stepstone.core.pin import pin_of
from stepstone.store.management import management_queries

ROWS = 20_000
GUARDED = {"instances", "commands", "history", "outbox"}


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


async def _seq_scans(conn: asyncpg.Connection, plans: list[dict[str, Any]], query: str, *args: Any) -> list[str]:
    """The guarded tables `query` scanned row by row, from the plans auto_explain sent while it ran: the
    instance lists and counts run their statement inside a function (migration 0064), whose plan EXPLAIN
    of the call does not show."""
    plans.clear()
    await conn.fetch(query, *args)
    await conn.execute("SELECT 1")  # the NOTICEs of the call above have arrived
    assert plans, query
    return [n["Relation Name"] for p in plans for n in _nodes(p["Plan"])
            if n.get("Node Type") == "Seq Scan" and n.get("Relation Name") in GUARDED]


async def _explained(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    """auto_explain on this session alone, nested statements too: the plans arrive in the returned list."""
    plans: list[dict[str, Any]] = []

    def collect(_: object, message: asyncpg.PostgresLogMessage) -> None:
        if "plan:" in message.message:
            plans.append(json.loads(message.message.split("plan:", 1)[1]))

    conn.add_log_listener(collect)
    for setting in ("LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0",
                    "SET auto_explain.log_nested_statements = on", "SET auto_explain.log_format = json",
                    "SET auto_explain.log_level = notice"):
        await conn.execute(setting)
    return plans


async def test_management_queries_use_indexes(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        await seed_waiting(conn, "stepstone", pin_of(waiting), 1, ROWS)
        await conn.execute("UPDATE stepstone.instances SET scope = 'acme' WHERE (hashtext(id::text) % 4) = 0")
        await conn.execute("UPDATE stepstone.instances SET business_key = md5(id::text)")
        await conn.execute(bench_queries("stepstone")["stage_events"], ROWS, 100, "seeded")
        await conn.execute("UPDATE stepstone.outbox SET published_at = now() WHERE id % 10 <> 0")
        await conn.execute(bench_queries("stepstone")["analyze"])
        q = management_queries("stepstone")
        some = uuid.UUID(str(await conn.fetchval("SELECT id FROM stepstone.instances LIMIT 1")))
        key = await conn.fetchval("SELECT business_key FROM stepstone.instances WHERE id = $1", some)
        now = datetime.now(UTC)
        cases = {
            "instances of one scope": (q["instances_page"], ["acme"], None, None, None, None, None, 51, False),
            "instances of one scope, next page": (q["instances_page"], ["acme"], None, None, None, now, some, 51,
                                                  False),
            "instances of every scope": (q["instances_page"], None, None, None, None, None, None, 51, False),
            "instances of every scope, archived too": (q["instances_page"], None, None, None, None, None, None, 51,
                                                       True),
            "failed instances": (q["instances_page"], None, "FAILED", None, None, None, None, 51, False),
            "counts of a business key": (q["instance_counts"], None, None, 10_000, False, key),
            "counts of a business key in one scope": (q["instance_counts"], ["acme"], None, 10_000, False, key),
            "counts of a business key of a workflow": (q["instance_counts"], None, "waiting", 10_000, False, key),
            "history": (q["history_page"], some, 0, 51, None),
            "history, failures only": (q["history_page"], some, 0, 51, sorted(FAILURE_KINDS)),
            "commands": (q["commands_page"], some, 0, 51, None),
            "outbox events": (q["instance_outbox"], some, 0, 51),
            "dead letters": (q["dead_commands_page"], ["acme"], None, 51, None),
            "dead letters of a workflow": (q["dead_commands_page"], ["acme"], None, 51, "waiting"),
            "instance scope": (q["instance_scope"], some),
            "scopes of a page of tasks' instances": (q["instance_scopes"], [some] * 50),
        }
        plans = await _explained(conn)
        found = {name: await _seq_scans(conn, plans, sql, *args) for name, (sql, *args) in cases.items()}
    finally:
        await conn.close()
    assert {name: scans for name, scans in found.items() if scans} == {}
