"""Shared fixtures: a session PostgreSQL server and a fresh migrated database per test.

Fixtures:
    pg_server            session; PgServer (admin_url, embedded, pgdata, bin_dir, server_version_num,
                         url_for(db, user=None), create_database(), drop_database(), execute())
    database_url         function; URL of a fresh database migrated to the current schema ("stepstone")
    empty_database_url   function; URL of a fresh empty database (nothing migrated)
    conn                 function, async; an asyncpg connection to ``database_url``
"""

from __future__ import annotations

import compileall
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest

from tests._pg import PgServer, start_server


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile stepstone's modules once, where Python is told not to write bytecode itself
    (PYTHONDONTWRITEBYTECODE is set on the project's machines). An editable install has no compiled
    modules, so every process the suite starts (about 150 doc commands, the CLI tests, the chaos rig's
    workers) compiled stepstone's 137 modules again: 0.2 s of a `stepstone --version` that takes 0.7 s."""
    if sys.dont_write_bytecode:
        root = Path(__file__).resolve().parent.parent
        for tree in ("src", "tests"):  # the tests too: the chaos rig's workers import their workflows
            compileall.compile_dir(root / tree, quiet=1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--server-tests-only", action="store_true",
        help="run only the tests that use the test database server (pg_server), for a second pass against "
             "another PostgreSQL, less the surfaces over the same SQL (_SURFACES): the others (the chaos "
             "rig's own server, the embedded default, pure code) would only run again unchanged",
    )


# The second pass is about the server: what differs between PostgreSQL versions is the SQL's behaviour
# and plans, which the engine, store, operations, outbox, chaos and plan tests exercise. These tests drive
# the same statements through a surface (command-line parsing and output, the HTTP API and UI, the
# testing kit), so a second server would only repeat them; they were 135 s of the pass's 590 s.
_SURFACES = ("tests/api/", "tests/testing_kit/", "tests/test_cli", "tests/test_text_arguments.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--server-tests-only"):
        return
    kept = [item for item in items if "pg_server" in getattr(item, "fixturenames", ())
            and item.get_closest_marker("first_pass_only") is None
            and not item.nodeid.startswith(_SURFACES)]
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


@pytest.fixture(autouse=True)
def _no_fleet_left_running() -> Iterator[None]:
    """A chaos test that fails before it stops its worker processes does not leave them to the next test."""
    yield
    fleet = sys.modules.get("tests.chaos.rig.fleet")
    if fleet is not None:
        fleet.stop_every_fleet()


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
