"""The row triggers a plain step commit consults, listed: each costs the parse of its WHEN on every
commit (docs/performance-history.md, "Trigger conditions"; `tests/perf/trigger_conditions.py` measures them)."""

from __future__ import annotations

import asyncpg

# What commit_decision writes on a plain step commit, one row per statement: the columns each UPDATE
# sets (a trigger with a column list is consulted only when the list meets them), or None for an INSERT.
STEP_COMMIT: list[tuple[str, str, frozenset[str] | None]] = [
    ("positions", "UPDATE", frozenset({"status", "step", "visit", "wait", "error", "lease_token", "lease_until",
                                       "lease_owner", "updated_at"})),
    ("instances", "UPDATE", frozenset({"status", "state", "state_version", "error", "step", "visit", "wait",
                                       "history_seq", "branches", "updated_at", "ended_at"})),
    ("commands", "UPDATE", frozenset({"state", "available_at", "attempt", "claims", "last_error", "settled_at"})),
    ("commands", "INSERT", None),
    ("history", "INSERT", None),
]

# Adding to this list adds a parse to every step commit: measure it first.
CONSULTED = [
    "commands INSERT commands_definition",  # about 1 µs: the commit names the definition (migration 0038)
    "commands INSERT commands_flow_start",
    "commands INSERT commands_notify",
    "commands INSERT commands_recorded",
    # a settle's only (a continuation in place sets no state): a signal queued behind the settled one
    # becomes available (migration 0072), a buffered message not applied goes on (0074)
    "commands UPDATE commands_left_queue",
    "commands UPDATE commands_notify_requeued",
    "history INSERT history_redact_baseline",
    "instances UPDATE instances_flow_status",
    "instances UPDATE instances_status_changed",
    "positions UPDATE positions_close_waits",
]

_TRIGGERS = """
SELECT c.relname AS rel, t.tgname AS name, t.tgtype::integer AS type,
       ARRAY(SELECT a.attname::text FROM pg_attribute a
             WHERE a.attrelid = t.tgrelid AND a.attnum = ANY(t.tgattr)) AS columns
FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
WHERE NOT t.tgisinternal AND t.tgenabled <> 'D' AND c.relnamespace = 'stepstone'::regnamespace
"""
_ROW, _INSERT, _UPDATE = 1, 4, 16  # pg_trigger.tgtype bits


async def test_a_step_commit_consults_few_triggers(conn: asyncpg.Connection) -> None:
    consulted = []
    for trigger in await conn.fetch(_TRIGGERS):
        for table, event, columns in STEP_COMMIT:
            fires_on = _INSERT if event == "INSERT" else _UPDATE
            if trigger["rel"] != table or not trigger["type"] & _ROW or not trigger["type"] & fires_on:
                continue
            if columns is not None and trigger["columns"] and not columns & set(trigger["columns"]):
                continue
            consulted.append(f"{table} {event} {trigger['name']}")
    assert sorted(consulted) == CONSULTED
