"""The test harness itself: each test gets its own migrated database."""

from __future__ import annotations

import asyncpg

from stepstone.store.migrate import shipped_migrations
from tests._pg import PgServer


async def test_conn_is_migrated(conn: asyncpg.Connection) -> None:
    versions = await conn.fetch("SELECT version FROM stepstone.schema_migrations ORDER BY version")
    assert [r["version"] for r in versions] == [m.version for m in shipped_migrations()]


async def test_databases_are_isolated(conn: asyncpg.Connection, pg_server: PgServer) -> None:
    await conn.execute("CREATE TABLE public.mine (id int)")
    other = pg_server.create_database(template=pg_server.template)
    try:
        c2 = await asyncpg.connect(pg_server.url_for(other))
        try:
            assert await c2.fetchval("SELECT to_regclass('public.mine')") is None
        finally:
            await c2.close()
    finally:
        pg_server.drop_database(other)


def test_sync_test_gets_database_url(database_url: str, pg_server: PgServer) -> None:
    assert database_url.startswith("postgresql://")
    assert (pg_server.bin_dir / "pg_ctl").exists()
    assert pg_server.embedded == (pg_server.pgdata is not None)
