"""The relay's claim walks the pending events in id order whatever the outbox's statistics say.

Planned on statistics older than the outbox's rows (a fresh database, or before autovacuum's next
ANALYZE after a large insert) the claim read and probed every pending event, then sorted them: 3.8 s
for 50 of 100,000 (tests/perf/outbox_claim_stats.py). The plans are captured with auto_explain as the
claim runs (its own statement and the statement inside the function it calls).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import asyncpg

from stepstone.store.outbox import PostgresOutbox, Settlement
from tests.outbox.conftest import past_the_horizon
from tests.perf.generic_plans import plan_nodes

EVENTS = 5_000
LIMIT = 50
STAGE = """INSERT INTO stepstone.outbox (event_id, instance_id, type, key, payload, created_at)
SELECT gen_random_uuid(), gen_random_uuid(), 'ev.made', 'k' || (g % 100), jsonb_build_object('n', g), now()
FROM generate_series(1, $1) AS g"""


async def claim_with_plans(conn: asyncpg.Connection, outbox: PostgresOutbox, limit: int, *, publish: bool = False
                           ) -> tuple[list[asyncpg.Record], list[dict[str, Any]]]:
    """One claim of `limit` with the plans auto_explain captured as it ran (nested statements too); with
    `publish` the batch is then settled as published, as a relay would."""
    plans: list[dict[str, Any]] = []

    def notice(_: object, message: asyncpg.PostgresLogMessage) -> None:
        if "plan:" in message.message:
            plans.append(json.loads(message.message.split("plan:", 1)[1]))

    for setting in ("LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0",
                    "SET auto_explain.log_analyze = on", "SET auto_explain.log_nested_statements = on",
                    "SET auto_explain.log_format = json", "SET auto_explain.log_level = notice"):
        await conn.execute(setting)
    conn.add_log_listener(notice)
    token = uuid.uuid4()

    async def once() -> list[asyncpg.Record]:
        plans.clear()
        return await conn.fetch(outbox.q["outbox_claim"], limit, 30.0, "r", token)

    rows = await past_the_horizon(once, bool)
    conn.remove_log_listener(notice)
    if publish:
        await outbox.settle(token, [Settlement(r["id"], "published") for r in rows])
    return rows, plans


def outbox_rows_read(plans: list[dict[str, Any]]) -> int:
    """Rows the plans produced from the outbox, each node's rows times its loops."""
    return sum(node.get("Actual Rows", 0) * node.get("Actual Loops", 1)
               for entry in plans for node in plan_nodes(entry["Plan"])
               if node.get("Relation Name") == "outbox")


async def test_a_claim_on_an_outbox_never_analyzed_reads_about_its_batch(
    conn: asyncpg.Connection, outbox: PostgresOutbox
) -> None:
    await conn.execute("ALTER TABLE stepstone.outbox SET (autovacuum_enabled = false)")  # no ANALYZE meanwhile
    await conn.execute(STAGE, EVENTS)
    rows, plans = await claim_with_plans(conn, outbox, LIMIT)
    assert [r["id"] for r in rows] == list(range(rows[0]["id"], rows[0]["id"] + LIMIT))
    assert await conn.fetchval("SELECT last_analyze IS NULL AND last_autoanalyze IS NULL FROM pg_stat_user_tables"
                               " WHERE relname = 'outbox' AND schemaname = 'stepstone'")
    # Rows the plans produced from the outbox, each node's rows times its loops: a walk of the batch
    # and a probe or two for each event it takes, not every pending event.
    read = outbox_rows_read(plans)
    assert plans and read <= 10 * LIMIT, read


HELD = """INSERT INTO stepstone.outbox (event_id, instance_id, type, key, payload, created_at, dead_at)
SELECT gen_random_uuid(), gen_random_uuid(), 'ev.made', 'held', jsonb_build_object('n', g), now(),
       CASE WHEN g = 0 THEN now() END
FROM generate_series(0, $1) AS g"""


async def test_a_key_held_back_with_a_backlog_is_skipped_not_walked(
    conn: asyncpg.Connection, outbox: PostgresOutbox
) -> None:
    """A dead event with 5,000 events of its key behind it, older than the 500 events of 100 other keys:
    the claim took the first claimable events after probing every one of the 5,000 (each claim, until an
    operator acted on the dead event); now it skips the key: one probe a key with unpublished events."""
    await conn.execute(HELD, EVENTS)
    await conn.execute(STAGE, 500)
    first_other = await conn.fetchval("SELECT min(id) FROM stepstone.outbox WHERE key <> 'held'")
    await conn.execute("ANALYZE stepstone.outbox")
    rows, plans = await claim_with_plans(conn, outbox, LIMIT, publish=True)
    assert [r["id"] for r in rows] == list(range(first_other, first_other + LIMIT))
    assert {r["key"] for r in rows} == {f"k{g % 100}" for g in range(1, LIMIT + 1)}
    # The oldest 4 x 50 + 100 unpublished events, one probe for each of the 101 keys, the run of each
    # key taken (up to the limit), the batch locked and leased: about 800 (5,851 before the skip).
    read = outbox_rows_read(plans)
    assert plans and read <= 20 * LIMIT, read
    # The rest of the held key stays behind its dead event while every other event is taken in order.
    rest, _ = await claim_with_plans(conn, outbox, 1_000)
    assert [r["id"] for r in rest] == list(range(first_other + LIMIT, first_other + 500))
