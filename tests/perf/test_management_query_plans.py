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


async def _seq_scans(conn: asyncpg.Connection, query: str, *args: Any) -> list[str]:
    raw = await conn.fetchval(f"EXPLAIN (FORMAT JSON) {query}", *args)
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    return [n["Relation Name"] for n in _nodes(plan)
            if n.get("Node Type") == "Seq Scan" and n.get("Relation Name") in GUARDED]


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
        found = {name: await _seq_scans(conn, sql, *args) for name, (sql, *args) in cases.items()}
    finally:
        await conn.close()
    assert {name: scans for name, scans in found.items() if scans} == {}
