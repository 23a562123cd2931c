"""The stepstone pytest plugin (registered through the ``pytest11`` entry point).

    # conftest.py
    @pytest.fixture
    def stepstone_registry():
        return myapp.flows.registry

    # test_orders.py
    async def test_order_ships(engine):
        iid = await engine.client.start("order", {...})
        await engine.advance(days=3)
        await engine.assert_step_ran(iid, "ship", times=1)

Fixtures: ``engine`` (an `Engine` on a database of its own, cloned from a migrated template made once
per session), ``stepstone_database`` (that database's URL), ``stepstone_registry`` (override it: the
workflows the engine runs), ``stepstone_server_url`` (the server: ``--stepstone-database-url``, else
``STEPSTONE_TEST_DATABASE_URL``, else a throwaway embedded PostgreSQL started for the session).
Nothing starts until a test asks for one of them.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    from pytest_asyncio import fixture as async_fixture
except ImportError:  # the plugin loads in every pytest run: without pytest-asyncio its async fixtures say so
    def async_fixture(fn: Any) -> Any:  # type: ignore[no-redef]
        @pytest.fixture(name=fn.__name__)
        def needs_pytest_asyncio() -> None:
            raise pytest.UsageError("the stepstone engine fixture needs pytest-asyncio (pip install pytest-asyncio)")
        return needs_pytest_asyncio

from stepstone.authoring.workflow import Registry
from stepstone.store.factory import TemplateDatabases
from stepstone.testing import Engine, open_engine

__all__ = ["pytest_addoption"]

URL_ENV = "STEPSTONE_TEST_DATABASE_URL"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("stepstone")
    group.addoption("--stepstone-database-url", default=None, metavar="URL",
                    help=f"PostgreSQL server for the engine fixture's databases (default: ${URL_ENV}, else an "
                         "embedded server started for the session)")


@pytest.fixture(scope="session")
def stepstone_server_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """The server the test databases are made on."""
    configured = request.config.getoption("--stepstone-database-url") or os.environ.get(URL_ENV)
    if configured:
        yield configured
        return
    from stepstone.store import embedded  # noqa: PLC0415 - only when no server is configured

    pgdata = Path(tempfile.mkdtemp(prefix="stepstone-pytest-")) / "pg"
    server = embedded.ensure_server(pgdata, announce=False)
    try:
        yield server.uri
    finally:
        embedded.stop_server(server.pgdata, mode="immediate")
        shutil.rmtree(pgdata.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def stepstone_templates(stepstone_server_url: str) -> Iterator[TemplateDatabases]:
    """The session's migrated template database."""
    templates = TemplateDatabases(stepstone_server_url)
    asyncio.run(templates.prepare())
    try:
        yield templates
    finally:
        asyncio.run(templates.close())


@async_fixture
async def stepstone_database(stepstone_templates: TemplateDatabases) -> AsyncIterator[str]:
    """The URL of a fresh, migrated database for this test, dropped after it."""
    url = await stepstone_templates.clone()
    try:
        yield url
    finally:
        await stepstone_templates.drop(url)


@pytest.fixture
def stepstone_registry() -> Registry:
    """The workflows the `engine` fixture runs: override this fixture in your conftest.py."""
    raise pytest.UsageError("the engine fixture runs the workflows of the stepstone_registry fixture: define "
                            "`@pytest.fixture def stepstone_registry(): return <your Registry>` in conftest.py")


@pytest.fixture
def stepstone_worker_config() -> dict[str, Any]:
    """WorkerConfig fields for the engine's worker (override to change concurrency, leases, ...)."""
    return {}


@async_fixture
async def engine(
    stepstone_database: str, stepstone_registry: Registry, stepstone_worker_config: dict[str, Any],
) -> AsyncIterator[Engine]:
    """A client and a worker on this test's own database, with time skipping (`advance(days=...)`)."""
    async with open_engine(stepstone_database, stepstone_registry, **stepstone_worker_config) as e:
        yield e
