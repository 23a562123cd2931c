"""schema.sql (the current full schema) must equal what the ordered migrations build, and migrations
after the first are additive (expand/contract)."""

from __future__ import annotations

import re

import asyncpg

from stepstone.core.model import STATUSES, TERMINAL
from stepstone.store import migrate as m
from stepstone.store.sqlfiles import read_text, render
from tests._pg import PgServer

_CATALOG = """
SELECT 'column' AS kind, c.relname || '.' || a.attname AS name,
       format_type(a.atttypid, a.atttypmod) || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END
       || coalesce(' default ' || pg_get_expr(d.adbin, d.adrelid), '')
       || coalesce(' statistics ' || nullif(a.attstattarget, -1), '') AS def
  FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
  LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
 WHERE c.relnamespace = $1::text::regnamespace AND a.attnum > 0 AND NOT a.attisdropped
       AND c.relkind IN ('r', 'p', 'v', 'm')
UNION ALL
SELECT 'relation', c.relname, c.relkind::text || coalesce(' ' || array_to_string(c.reloptions, ','), '')
  FROM pg_class c WHERE c.relnamespace = $1::text::regnamespace
UNION ALL
SELECT 'constraint', conrelid::regclass::text || '.' || conname, pg_get_constraintdef(oid)
  FROM pg_constraint WHERE connamespace = $1::text::regnamespace
UNION ALL
SELECT 'index', indexname, indexdef FROM pg_indexes WHERE schemaname = $1::text
UNION ALL
SELECT 'function', p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')', pg_get_functiondef(p.oid)
  FROM pg_proc p WHERE p.pronamespace = $1::text::regnamespace
UNION ALL
SELECT 'trigger', tgrelid::regclass::text || '.' || tgname, pg_get_triggerdef(oid) || ' enabled ' || tgenabled::text
  FROM pg_trigger WHERE NOT tgisinternal AND tgrelid IN
       (SELECT oid FROM pg_class WHERE relnamespace = $1::text::regnamespace)
UNION ALL
SELECT 'type', t.typname, t.typtype::text FROM pg_type t
 WHERE t.typnamespace = $1::text::regnamespace AND t.typtype IN ('e', 'c', 'd') AND t.typrelid = 0
ORDER BY 1, 2
"""
_BOOKKEEPING = re.compile(r"schema_migrations")


async def _describe(url: str, schema: str) -> list[tuple[str, str, str]]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(_CATALOG, schema)
    finally:
        await conn.close()
    return [(r["kind"], r["name"], r["def"]) for r in rows if not _BOOKKEEPING.search(r["name"])]


async def test_schema_sql_equals_migrations(pg_server: PgServer, database_url: str) -> None:
    fresh = pg_server.create_database()
    try:
        url = pg_server.url_for(fresh)
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(render("CREATE SCHEMA {{schema}};\n" + read_text("schema.sql"), "stepstone"))
        finally:
            await conn.close()
        from_schema = await _describe(url, "stepstone")
    finally:
        pg_server.drop_database(fresh)
    from_migrations = await _describe(database_url, "stepstone")
    assert from_schema, "schema.sql creates something"
    assert from_schema == from_migrations


_DEFINITION = re.compile(r"^CREATE (?:OR REPLACE )?FUNCTION \{\{schema\}\}\.(\w+)\(([^)]*)\)", re.MULTILINE)


def test_schema_sql_defines_each_function_once() -> None:
    """A migration that replaces a function changes its one definition in schema.sql; a second definition
    further down would leave the first one dead text that still reads as the schema."""
    seen: dict[str, int] = {}
    for hit in _DEFINITION.finditer(read_text("schema.sql")):
        signature = hit.group(1) + "(" + " ".join(hit.group(2).split()) + ")"
        seen[signature] = seen.get(signature, 0) + 1
    assert [name for name, count in seen.items() if count > 1] == []


_NOT_ADDITIVE = re.compile(r"\b(DROP\s+(?!INDEX\s+CONCURRENTLY\s+IF)|RENAME\b|SET\s+NOT\s+NULL)", re.IGNORECASE)


def test_later_migrations_are_additive() -> None:
    offenders = []
    for migration in m.shipped_migrations()[1:]:
        body = re.sub(r"--[^\n]*", "", migration.sql)
        offenders += [f"{migration.version:04d}: {hit.group(0)}" for hit in _NOT_ADDITIVE.finditer(body)]
    assert offenders == [], "migrations after the first must be additive (expand/contract)"


async def test_documents_of_hot_tables_carry_no_statistics(database_url: str) -> None:
    """No statement filters on a document, and sorting jsonb for its histogram was most of an ANALYZE of
    history (migration 0034): a document column added to a table the worker analyzes leaves it out."""
    conn = await asyncpg.connect(database_url)
    try:
        gathered = await conn.fetch(
            """SELECT c.relname || '.' || a.attname AS name FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
                WHERE c.relnamespace = 'stepstone'::regnamespace AND a.atttypid = 'jsonb'::regtype
                  AND c.relname IN ('instances', 'positions', 'commands', 'history')
                  AND a.attnum > 0 AND NOT a.attisdropped AND coalesce(nullif(a.attstattarget, -1), 100) <> 0""")
    finally:
        await conn.close()
    assert [r["name"] for r in gathered] == []


async def test_the_database_and_the_core_agree_on_what_has_ended(database_url: str) -> None:
    """is_terminal (migration 0044) is what signals and migrations ask in SQL; core.model.TERMINAL what the
    Python side asks: the same four statuses."""
    conn = await asyncpg.connect(database_url)
    try:
        ended = {s for s in STATUSES if await conn.fetchval("SELECT stepstone.is_terminal($1)", s)}
    finally:
        await conn.close()
    assert ended == set(TERMINAL)
