"""The migration runner against real PostgreSQL."""

from __future__ import annotations

import asyncio
import hashlib
import re
import uuid

import asyncpg
import pytest

from stepstone.errors import InsufficientPrivilege, SchemaTooNew
from stepstone.store import migrate as m
from stepstone.store.sqlfiles import render


def _fake(version: int, sql: str) -> m.Migration:
    return m.Migration(version, f"fake_{version}", sql, hashlib.sha256(sql.encode()).hexdigest())


@pytest.fixture
def two_migrations(monkeypatch: pytest.MonkeyPatch) -> tuple[m.Migration, ...]:
    shipped = (*m.shipped_migrations(), _fake(9001, "CREATE TABLE {{schema}}.extra (id int);"))
    monkeypatch.setattr(m, "shipped_migrations", lambda: shipped)
    return shipped


def test_render_quotes_schema() -> None:
    assert render("SELECT * FROM {{schema}}.t, {{schema}}.u", "wf") == 'SELECT * FROM "wf".t, "wf".u'


def test_shipped_files_are_ordered_and_named() -> None:
    shipped = m.shipped_migrations()
    assert shipped, "at least the initial migration ships"
    assert [x.version for x in shipped] == sorted({x.version for x in shipped})
    assert shipped[0].version == 1


async def test_migrate_fresh_then_noop(empty_database_url: str) -> None:
    conn = await asyncpg.connect(empty_database_url)
    try:
        before = await m.status(conn, "wf")
        assert before.applied == [] and len(before.pending) == len(m.shipped_migrations())
        assert await conn.fetchval("SELECT to_regnamespace('wf')") is None  # status creates nothing
        applied = await m.migrate(conn, "wf")
        assert [x.version for x in applied] == [x.version for x in m.shipped_migrations()]
        assert await m.migrate(conn, "wf") == []
        after = await m.status(conn, "wf")
        assert after.pending == [] and after.unknown == [] and after.modified == []
        assert after.current_version == m.shipped_migrations()[-1].version
    finally:
        await conn.close()


async def test_concurrent_migrators_apply_each_version_once(
    empty_database_url: str, two_migrations: tuple[m.Migration, ...]
) -> None:
    conns = [await asyncpg.connect(empty_database_url) for _ in range(3)]
    try:
        results = await asyncio.gather(*(m.migrate(c, "wf") for c in conns))
        applied = sorted(x.version for result in results for x in result)
        assert applied == [x.version for x in two_migrations]
        rows = await conns[0].fetch("SELECT version FROM wf.schema_migrations ORDER BY version")
        assert [r["version"] for r in rows] == [x.version for x in two_migrations]
    finally:
        for c in conns:
            await c.close()


async def test_history_newer_than_shipped_is_refused(
    empty_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = await asyncpg.connect(empty_database_url)
    try:
        await m.migrate(conn, "wf")
        await conn.execute(
            "INSERT INTO wf.schema_migrations (version, name, checksum) VALUES (9999, 'future', 'x')"
        )
        shipped = (*m.shipped_migrations(), _fake(9001, "CREATE TABLE {{schema}}.extra (id int);"))
        monkeypatch.setattr(m, "shipped_migrations", lambda: shipped)
        with pytest.raises(SchemaTooNew, match="9999") as info:
            await m.migrate(conn, "wf")
        assert info.value.unknown_versions == (9999,)
        assert await conn.fetchval("SELECT to_regclass('wf.extra')") is None  # nothing applied
        assert (await m.status(conn, "wf")).unknown == [9999]
    finally:
        await conn.close()


async def test_failing_migration_rolls_back_alone(
    empty_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped = (*m.shipped_migrations(), _fake(9001, "CREATE TABLE {{schema}}.half (id int); SELECT 1/0;"))
    monkeypatch.setattr(m, "shipped_migrations", lambda: shipped)
    conn = await asyncpg.connect(empty_database_url)
    try:
        with pytest.raises(asyncpg.DivisionByZeroError):
            await m.migrate(conn, "wf")
        state = await m.status(conn, "wf")
        assert [x.version for x in state.pending] == [9001]
        assert await conn.fetchval("SELECT to_regclass('wf.half')") is None
    finally:
        await conn.close()


async def test_modified_file_is_reported(empty_database_url: str) -> None:
    conn = await asyncpg.connect(empty_database_url)
    try:
        await m.migrate(conn, "wf")
        await conn.execute("UPDATE wf.schema_migrations SET checksum = 'old' WHERE version = 1")
        assert (await m.status(conn, "wf")).modified == [1]
    finally:
        await conn.close()


async def test_pending_sql_runs_as_is(empty_database_url: str) -> None:
    text = m.pending_sql("wf")
    assert "{{schema}}" not in text and '"wf".schema_migrations' in text
    conn = await asyncpg.connect(empty_database_url)
    try:
        # As psql runs it: each statement of a migration marked to run outside a transaction block on
        # its own (one query string of several statements is one implicit transaction).
        for chunk in re.split(r"^(?=-- \d{4}_)", text, flags=re.MULTILINE):
            if "(run these statements outside a transaction block)" in chunk:
                for statement in re.split(r";\s*$", chunk, flags=re.MULTILINE):
                    if re.sub(r"^--[^\n]*$", "", statement, flags=re.MULTILINE).strip():
                        await conn.execute(statement)
            elif chunk.strip():
                await conn.execute(chunk)
        assert (await m.status(conn, "wf")).pending == []
    finally:
        await conn.close()
    assert "0001_" not in m.pending_sql("wf", frozenset({1}))


async def test_a_migration_outside_a_transaction_runs_each_statement_on_its_own(
    empty_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    contract = _fake(9002, f"{m.OUTSIDE_A_TRANSACTION}\n-- builds an index, then drops it, without blocking writers\n"
                           "CREATE INDEX CONCURRENTLY IF NOT EXISTS extra_id ON {{schema}}.extra (id);\n"
                           "DROP INDEX CONCURRENTLY IF EXISTS {{schema}}.extra_id;\n")
    assert not contract.transactional and len(contract.statements("wf")) == 2
    shipped = (*m.shipped_migrations(), _fake(9001, "CREATE TABLE {{schema}}.extra (id int);"), contract)
    monkeypatch.setattr(m, "shipped_migrations", lambda: shipped)
    conn = await asyncpg.connect(empty_database_url)
    try:
        applied = await m.migrate(conn, "wf")
        assert [x.version for x in applied][-2:] == [9001, 9002]
        assert await conn.fetchval("SELECT to_regclass('wf.extra_id')") is None
        assert (await m.status(conn, "wf")).pending == []
        # Interrupted after its first statement: the next migrator runs the file again, to the end.
        await conn.execute("DELETE FROM wf.schema_migrations WHERE version = 9002")
        await conn.execute('CREATE INDEX extra_id ON "wf".extra (id)')
        assert [x.version for x in await m.migrate(conn, "wf")] == [9002]
        assert await conn.fetchval("SELECT to_regclass('wf.extra_id')") is None
    finally:
        await conn.close()


def test_lock_key_is_stable_and_per_schema() -> None:
    assert m.advisory_lock_key("a") == m.advisory_lock_key("a") != m.advisory_lock_key("b")
    assert -(2**63) <= m.advisory_lock_key("a") < 2**63


async def test_schema_owned_by_another_role_is_refused(empty_database_url: str) -> None:
    """The schema's owner could later replace commit_segment: migrating into it is refused, untouched."""
    conn = await asyncpg.connect(empty_database_url)
    role = f"intruder_{uuid.uuid4().hex[:8]}"
    try:
        await conn.execute(f'CREATE ROLE "{role}"')
        await conn.execute(f'CREATE SCHEMA wf AUTHORIZATION "{role}"')
        with pytest.raises(InsufficientPrivilege, match=f"owned by role {role}") as info:
            await m.migrate(conn, "wf")
        assert len(str(info.value).splitlines()) == 1
        assert await conn.fetchval("SELECT to_regclass('wf.schema_migrations')") is None  # nothing created
        await conn.execute(f'ALTER SCHEMA wf OWNER TO "{await conn.fetchval("SELECT current_user")}"')
        assert [x.version for x in await m.migrate(conn, "wf")] == [x.version for x in m.shipped_migrations()]
    finally:
        await conn.execute("DROP SCHEMA IF EXISTS wf CASCADE")
        await conn.execute(f'DROP ROLE IF EXISTS "{role}"')
        await conn.close()


LISTING = ("instances_created", "instances_status_created", "instances_scope_created", "instances_definition_created")


async def test_the_listing_indexes_are_rebuilt_ascending_and_a_rerun_repairs_an_interrupted_build(
    empty_database_url: str,
) -> None:
    conn = await asyncpg.connect(empty_database_url)

    async def listing() -> dict[str, bool]:
        rows = await conn.fetch(
            "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = 'wf' AND c.relname LIKE 'instances\\_%' AND c.relname NOT LIKE '%pkey'"
            " AND (c.relname LIKE '%\\_created' OR c.relname LIKE '%\\_newest')")
        return {r["relname"]: r["indisvalid"] for r in rows}

    try:
        await m.migrate(conn, "wf")
        assert await listing() == dict.fromkeys(LISTING, True)
        definition = await conn.fetchval("SELECT pg_get_indexdef('wf.instances_status_created'::regclass)")
        assert definition.endswith("(status, created_at, id)")  # ascending: read backwards, newest first
        # Interrupted: one build left invalid (as a cancelled CREATE INDEX CONCURRENTLY leaves it; only a
        # superuser can fake that), one old index not yet dropped, the version not recorded. The next
        # migrator runs the file again.
        if await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user"):
            await conn.execute(
                "UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'wf.instances_created'::regclass")
        await conn.execute('CREATE INDEX instances_scope_newest ON "wf".instances (scope, created_at DESC, id DESC)')
        await conn.execute("DELETE FROM wf.schema_migrations WHERE version = 27")
        assert [x.version for x in await m.migrate(conn, "wf")] == [27]
        assert await listing() == dict.fromkeys(LISTING, True)
    finally:
        await conn.close()
