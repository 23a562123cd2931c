"""EXPLAIN guard: fetch-and-lock finds open tasks of a topic through the partial index, never a Seq
Scan over every task ever opened (with enough ended tasks that the planner would scan if it could)."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from stepstone.store.queries import named_queries

_SEED = """
INSERT INTO stepstone.external_tasks (id, instance_id, position, step, visit, topic, payload, status, retries,
                                      backoff, available_at, created_at, updated_at)
SELECT gen_random_uuid(), gen_random_uuid(), '', 'charge', 1, 'topic-' || (n % 20),
       '{}'::jsonb, CASE WHEN n % 100 = 0 THEN 'OPEN' ELSE 'COMPLETED' END, 3, '{}'::jsonb, now(), now(), now()
FROM generate_series(1, 30000) AS n
"""


def _scans(plan: dict[str, Any]) -> list[str]:
    found = [plan["Relation Name"]] if plan.get("Node Type") == "Seq Scan" and "Relation Name" in plan else []
    for child in plan.get("Plans", []):
        found += _scans(child)
    return found


async def test_fetch_uses_the_open_index(conn: asyncpg.Connection) -> None:
    await conn.execute(_SEED)
    await conn.execute("ANALYZE stepstone.external_tasks")
    query = named_queries("external.sql", "stepstone")["external_fetch"]
    [row] = await conn.fetch("EXPLAIN (FORMAT JSON) " + query, ["topic-3"], 10, "w", 30.0)
    plan = json.loads(row[0])[0]["Plan"]
    assert "external_tasks" not in _scans(plan), json.dumps(plan)[:2000]
    assert "external_tasks_open" in json.dumps(plan)
