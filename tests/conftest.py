"""Shared fixtures: a session PostgreSQL server and a fresh migrated database per test.

Fixtures:
    pg_server            session; PgServer (admin_url, embedded, pgdata, bin_dir, server_version_num,
                         url_for(db, user=None), create_database(), drop_database(), execute())
    database_url         function; URL of a fresh database migrated to the current schema ("stepstone")
    empty_database_url   function; URL of a fresh empty database (nothing migrated)
    conn                 function, async; an asyncpg connection to ``database_url``
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from tests._pg import PgServer, start_server


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--server-tests-only", action="store_true",
        help="run only the tests that use the test database server (pg_server), for a second pass against "
             "another PostgreSQL: the others (the chaos rig's own server, the embedded default, pure code) "
             "would only run again unchanged",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--server-tests-only"):
        return
    kept = [item for item in items if "pg_server" in getattr(item, "fixturenames", ())
            and item.get_closest_marker("first_pass_only") is None]
    dropped = [item for item in items if item not in kept]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


_ISOLATED_ENV = ("STEPSTONE_DATABASE_URL", "DATABASE_URL", "STEPSTONE_SCHEMA", "STEPSTONE_BROKER_URL")


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never pick up the developer's database settings."""
    for name in _ISOLATED_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    server, cleanup = start_server()
    try:
        yield server
    finally:
        cleanup()


@pytest.fixture
def database_url(pg_server: PgServer) -> Iterator[str]:
    name = pg_server.take_clone()
    try:
        yield pg_server.url_for(name)
    finally:
        pg_server.drop_later(name)


@pytest.fixture
def empty_database_url(pg_server: PgServer) -> Iterator[str]:
    name = pg_server.create_database()
    try:
        yield pg_server.url_for(name)
    finally:
        pg_server.drop_later(name)


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(database_url)
    try:
        yield connection
    finally:
        await connection.close()
