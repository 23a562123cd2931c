"""The relay's claim walks the pending events in id order whatever the outbox's statistics say.

Planned on statistics older than the outbox's rows (a fresh database, or before autovacuum's next
ANALYZE after a large insert) the claim read and probed every pending event, then sorted them: 3.8 s
for 50 of 100,000 (tests/perf/outbox_claim_stats.py). The plans are captured with auto_explain as the
claim runs (its own statement and the statement inside the function it calls).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import asyncpg

from stepstone.store.outbox import PostgresOutbox
from tests.perf.generic_plans import plan_nodes

EVENTS = 5_000
LIMIT = 50
STAGE = """INSERT INTO stepstone.outbox (event_id, instance_id, type, key, payload, created_at)
SELECT gen_random_uuid(), gen_random_uuid(), 'ev.made', 'k' || (g % 100), jsonb_build_object('n', g), now()
FROM generate_series(1, $1) AS g"""


async def test_a_claim_on_an_outbox_never_analyzed_reads_about_its_batch(
    conn: asyncpg.Connection, outbox: PostgresOutbox
) -> None:
    await conn.execute("ALTER TABLE stepstone.outbox SET (autovacuum_enabled = false)")  # no ANALYZE meanwhile
    await conn.execute(STAGE, EVENTS)
    plans: list[dict[str, Any]] = []

    def notice(_: object, message: asyncpg.PostgresLogMessage) -> None:
        if "plan:" in message.message:
            plans.append(json.loads(message.message.split("plan:", 1)[1]))

    for setting in ("LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0",
                    "SET auto_explain.log_analyze = on", "SET auto_explain.log_nested_statements = on",
                    "SET auto_explain.log_format = json", "SET auto_explain.log_level = notice"):
        await conn.execute(setting)
    conn.add_log_listener(notice)
    deadline = asyncio.get_running_loop().time() + 30.0
    while True:  # a transaction elsewhere on the server may hold the visibility horizon for a moment
        plans.clear()
        rows = await conn.fetch(outbox.q["outbox_claim"], LIMIT, 30.0, "r", uuid.uuid4())
        if rows or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.01)
    conn.remove_log_listener(notice)
    assert [r["id"] for r in rows] == list(range(rows[0]["id"], rows[0]["id"] + LIMIT))
    assert await conn.fetchval("SELECT last_analyze IS NULL AND last_autoanalyze IS NULL FROM pg_stat_user_tables"
                               " WHERE relname = 'outbox' AND schemaname = 'stepstone'")
    # Rows the plans produced from the outbox, each node's rows times its loops: a walk of the batch
    # and a probe or two for each event it takes, not every pending event.
    read = sum(node.get("Actual Rows", 0) * node.get("Actual Loops", 1)
               for entry in plans for node in plan_nodes(entry["Plan"])
               if node.get("Relation Name") == "outbox")
    assert plans and read <= 10 * LIMIT, read
