"""Least privilege: a runtime role with exactly the grants `stepstone db grant` gives runs the worker,
the client and retention, and cannot alter the schema; a read-only role reads and changes nothing."""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from collections.abc import Iterator
from datetime import timedelta
from urllib.parse import urlsplit

import asyncpg
import pytest
from click.testing import CliRunner

from stepstone.cli import cli
from stepstone.errors import InvalidInput
from stepstone.ops import Operations
from stepstone.store.factory import open_store
from stepstone.store.health import server_version_num
from stepstone.store.operations_pg import grant_statements
from stepstone.testing import open_engine
from tests._pg import PgServer
from tests.ops import workflows


def _database(url: str) -> str:
    """The database a URL names (an embedded server's URL names its socket directory in the query)."""
    return urlsplit(url).path.lstrip("/")


@pytest.fixture
def roles(pg_server: PgServer, database_url: str) -> Iterator[tuple[str, str]]:
    """A runtime role and a read-only role (LOGIN, no other rights), dropped afterwards."""
    suffix = uuid.uuid4().hex[:8]
    runtime, reader = f"rt_{suffix}", f"ro_{suffix}"
    for role in (runtime, reader):
        pg_server.execute(f"CREATE ROLE {role} LOGIN")
    try:
        yield runtime, reader
    finally:
        async def drop() -> None:
            conn = await asyncpg.connect(database_url)
            try:
                for role in (runtime, reader):
                    await conn.execute(f"DROP OWNED BY {role}")
            finally:
                await conn.close()

        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # off any loop the test left running
            pool.submit(asyncio.run, drop()).result()
        for role in (runtime, reader):
            pg_server.execute(f"DROP ROLE IF EXISTS {role}")


def test_db_grant_prints_the_statements(database_url: str) -> None:
    result = CliRunner().invoke(cli, ["--database-url", database_url, "db", "grant", "app_rt"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert 'GRANT USAGE ON SCHEMA "stepstone" TO "app_rt";' in lines
    assert 'GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA "stepstone" TO "app_rt";' in lines
    assert not any("CREATE" in line or "ALL PRIVILEGES" in line for line in lines)
    # MAINTAIN (PostgreSQL 17 and later) on the hot tables, so that workers may ANALYZE them.
    maintain = [line for line in lines if "MAINTAIN" in line]
    assert len(maintain) == (1 if asyncio.run(_server_version(database_url)) >= 170_000 else 0)
    ro = CliRunner().invoke(cli, ["--database-url", database_url, "db", "grant", "dash", "--read-only"])
    assert "GRANT SELECT ON ALL TABLES IN SCHEMA" in ro.stdout and "INSERT" not in ro.stdout
    assert "MAINTAIN" not in ro.stdout


def test_db_grant_apply_to_a_role_that_does_not_exist_is_one_line(database_url: str) -> None:
    """It was the driver's UndefinedObjectError, a traceback."""
    result = CliRunner().invoke(cli, ["--database-url", database_url, "db", "grant", "no_such_role_x", "--apply"])
    assert result.exit_code == 1, result.output
    assert result.output.strip() == ('error: role "no_such_role_x" does not exist: create it first '
                                     "(CREATE ROLE ... LOGIN), then grant")


async def _server_version(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return await server_version_num(conn, "stepstone")
    finally:
        await conn.close()


async def test_the_runtime_role_runs_everything_and_cannot_alter_the_schema(
    pg_server: PgServer, database_url: str, roles: tuple[str, str]
) -> None:
    runtime, reader = roles
    for role, extra in ((runtime, []), (reader, ["--read-only"])):
        args = ["--database-url", database_url, "db", "grant", role, *extra, "--apply"]
        result = await asyncio.to_thread(CliRunner().invoke, cli, args)
        assert result.exit_code == 0, result.output
    url = pg_server.url_for(_database(database_url), user=runtime)

    async with open_engine(url, workflows.registry, concurrency=2) as engine:
        ops = Operations.on(engine.store, actor="rt")
        assert await ops.role_can_alter_schema() == (runtime, False)
        iid = await engine.client.start(workflows.flaky, {})
        failing = await engine.client.start(workflows.flaky, {})
        await workflows.failed_for_good(engine, failing)
        assert (await engine.client.get(iid)).status == "COMPLETED"
        assert (await ops.retry([failing])).succeeded == 1
        await engine.run_until_idle()
        # A signal whose payload is redacted at its commit, and a child: feature sections of later migrations.
        confirmed = await engine.client.start(workflows.confirmed, {"order": "o-1", "card": "4000"})
        await engine.run_until_idle()
        await engine.client.signal(confirmed, "otp", {"otp": "123456"})
        await workflows.run_out_backoffs(engine, rounds=2)
        assert (await engine.client.get(confirmed)).status == "COMPLETED"
        await ops.set_retention_policy("*", "completed", timedelta(days=1), timedelta(0))
        await engine.move_clock(2 * 86_400)
        report = await ops.retention_run()
        # The two and the child; the confirmation holds an event no relay published yet.
        assert (report.purged, report.held_unsent) == (3, 1)
        conn = await asyncpg.connect(url)
        try:
            if await _server_version(url) >= 170_000:  # MAINTAIN: the workers' statistics upkeep works
                await engine.store.refresh_statistics(rows=0)  # rows=0: due at once, whatever the counts say
                assert await conn.fetchval(
                    "SELECT count(*) FROM pg_stat_user_tables WHERE schemaname = 'stepstone' "
                    "AND relname IN ('instances', 'positions', 'commands', 'history') "
                    "AND last_analyze IS NOT NULL") == 4, "the runtime role did not analyze"  # not autovacuum's
            for ddl in ("ALTER TABLE stepstone.instances ADD COLUMN evil integer",
                        "CREATE TABLE stepstone.evil (id integer)",
                        "DROP TABLE stepstone.history",
                        ("CREATE OR REPLACE FUNCTION stepstone.db_now() RETURNS timestamptz LANGUAGE sql "
                         "AS 'SELECT now()'")):
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await conn.execute(ddl)
        finally:
            await conn.close()

    reader_url = pg_server.url_for(_database(database_url), user=reader)
    store = await open_store(reader_url)
    try:
        ops = Operations.on(store)
        assert (await ops.find()).items == []  # it reads
        assert (await ops.retention_policies())
        with pytest.raises(Exception, match="permission denied"):
            await ops.set_retention_policy("*", "completed", timedelta(days=2))
    finally:
        await store.close()


def test_db_grant_quotes_any_role_name_and_refuses_one_postgresql_cannot_hold(
    pg_server: PgServer, database_url: str
) -> None:
    """A role name outside [a-z0-9_] was refused as an "invalid schema name"; PostgreSQL holds any name
    of 1 to 63 bytes, quoted as an identifier."""
    role = f'App-RT "{uuid.uuid4().hex[:6]}"'
    quoted = '"' + role.replace('"', '""') + '"'
    printed = CliRunner().invoke(cli, ["--database-url", database_url, "db", "grant", role])
    assert printed.exit_code == 0, printed.output
    assert f'GRANT USAGE ON SCHEMA "stepstone" TO {quoted};' in printed.stdout.splitlines()
    pg_server.execute(f"CREATE ROLE {quoted} LOGIN")
    try:
        applied = CliRunner().invoke(cli, ["--database-url", database_url, "db", "grant", role, "--read-only",
                                           "--apply"])
        assert applied.exit_code == 0, applied.output

        async def can_read() -> bool:
            conn = await asyncpg.connect(database_url)
            try:
                return bool(await conn.fetchval("SELECT has_table_privilege($1, 'stepstone.instances', 'SELECT')",
                                                role))
            finally:
                await conn.close()

        assert asyncio.run(can_read())
    finally:
        async def drop() -> None:
            conn = await asyncpg.connect(database_url)
            try:
                await conn.execute(f"DROP OWNED BY {quoted}")
            finally:
                await conn.close()

        asyncio.run(drop())
        pg_server.execute(f"DROP ROLE IF EXISTS {quoted}")
    refused = CliRunner().invoke(cli, ["--database-url", database_url, "db", "grant", "é" * 32])
    assert refused.exit_code == 1, refused.output
    assert refused.stderr.strip() == f"error: invalid role name {'é' * 32!r}: longer than 63 bytes"
    for bad, why in (("", "it is empty"), ("a\0b", "it contains a NUL character")):  # what the CLI's TEXT refuses
        with pytest.raises(InvalidInput, match=f"invalid role name .*: {why}"):
            grant_statements("stepstone", bad)
