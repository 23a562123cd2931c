"""EXPLAIN guard: at 100,000 open tasks every inbox mode, and its count, is found through the task
indexes, never by reading the whole table; with custom and with generic plans (a prepared statement
switches to a generic plan after a few runs)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import asyncpg

from stepstone.store.postgres import PostgresStore
from stepstone.store.task_port import TaskFilter, TaskQuery

_FILL = """
INSERT INTO stepstone.tasks (id, instance_id, position, step, visit, scope, definition_id, status, title,
                             assignee, candidate_users, candidate_groups, priority, decisions, form, data,
                             state_version, created_at, updated_at, due_at)
SELECT gen_random_uuid(), gen_random_uuid(), '', 'approve', 1, 'default', 'wf' || (n % 20),
       CASE WHEN n % 10 = 0 THEN 'COMPLETED' ELSE 'OPEN' END, 'Task number ' || n,
       CASE WHEN n % 3 = 0 THEN 'user' || (n % 2000) END,
       ARRAY['user' || ((n * 7) % 2000)], ARRAY['group' || (n % 200)], n % 100, ARRAY['ok'], '{}', '{}', 0,
       now() - make_interval(secs => n), now(), now() + make_interval(hours => n % 500)
FROM generate_series(1, $1) AS n
"""


def _scans(plan: Any) -> list[str]:
    """Every node type of a JSON plan that reads the tasks table."""
    found = []
    if isinstance(plan, dict):
        if plan.get("Relation Name") == "tasks":
            found.append(str(plan.get("Node Type")))
        for value in plan.values():
            found += _scans(value)
    elif isinstance(plan, list):
        for value in plan:
            found += _scans(value)
    return found


async def test_inbox_queries_use_the_task_indexes(database_url: str) -> None:
    store = await PostgresStore.open(database_url)
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(_FILL, 111_112)
        await conn.execute("ANALYZE stepstone.tasks")
        assert await conn.fetchval("SELECT count(*) FROM stepstone.tasks WHERE status = 'OPEN'") >= 100_000
        for mode in ("inbox", "assigned", "candidate", "all"):
            await _check(conn, store, mode)
    finally:
        await conn.close()
        await store.close()


async def _check(conn: asyncpg.Connection, store: PostgresStore, mode: Any) -> None:
    groups = ["group7", "group8"] if mode != "all" else ["group7"]
    query = TaskQuery(mode=mode, user="user42", groups=groups, where=TaskFilter(
        due_before=datetime(2100, 1, 1, tzinfo=UTC), text="number", follow_up_before=datetime(2100, 1, 1, tzinfo=UTC),
        hide_later_follow_ups=True, scope="default", scopes=("default", "acme")))
    args = store._inbox_args(query)
    for cache_mode in ("force_custom_plan", "force_generic_plan"):
        await conn.execute(f"SET plan_cache_mode = {cache_mode}")
        for count in (False, True):
            sql = store._inbox_sql(query, count=count)
            params = args if count else [*args, None, None, None, 50]
            plan = json.loads(await conn.fetchval(f"EXPLAIN (FORMAT JSON) {sql}", *params))
            scans = _scans(plan)
            assert scans, plan
            assert "Seq Scan" not in scans, (mode, cache_mode, count, scans)
