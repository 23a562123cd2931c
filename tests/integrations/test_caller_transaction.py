"""Start and signal inside the caller's own transaction: the instance exists exactly when the caller's
business write commits, and not at all when it rolls back; with every supported driver."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import asyncpg
import pytest

from stepstone.errors import BusinessKeyInUse, InvalidInput
from stepstone.testing import Engine, open_engine
from tests.scheduling import workflows
from tests.scheduling.workflows import long, report

Tx = Callable[[], AbstractAsyncContextManager[tuple[Any, Callable[[str], Awaitable[None]]]]]
"""Opens the caller's transaction: yields (connection for stepstone, run(sql) for the business write);
commits on a clean exit, rolls back when the block raises."""


class Rollback(Exception):
    pass


def _asyncpg(url: str) -> Tx:
    @asynccontextmanager
    async def tx() -> AsyncIterator[tuple[Any, Callable[[str], Awaitable[None]]]]:
        conn = await asyncpg.connect(url)
        try:
            async with conn.transaction():
                async def run(sql: str) -> None:
                    await conn.execute(sql)
                yield conn, run
        finally:
            await conn.close()
    return tx


def _psycopg_async(url: str) -> Tx:
    psycopg = pytest.importorskip("psycopg", reason="psycopg 3 is in the test extra")

    @asynccontextmanager
    async def tx() -> AsyncIterator[tuple[Any, Callable[[str], Awaitable[None]]]]:
        async with await psycopg.AsyncConnection.connect(url) as conn, conn.transaction():
            async def run(sql: str) -> None:
                await conn.execute(sql)
            yield conn, run
    return tx


def _psycopg_sync(url: str) -> Tx:
    psycopg = pytest.importorskip("psycopg", reason="psycopg 3 is in the test extra")

    @asynccontextmanager
    async def tx() -> AsyncIterator[tuple[Any, Callable[[str], Awaitable[None]]]]:
        with psycopg.connect(url) as conn, conn.transaction():
            async def run(sql: str) -> None:
                conn.execute(sql)
            yield conn, run
    return tx


def _sqlalchemy_async(url: str) -> Tx:
    pytest.importorskip("sqlalchemy", reason="SQLAlchemy is in the test extra")
    from sqlalchemy import text  # noqa: PLC0415
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine  # noqa: PLC0415

    @asynccontextmanager
    async def tx() -> AsyncIterator[tuple[Any, Callable[[str], Awaitable[None]]]]:
        engine = create_async_engine(url.replace("postgresql://", "postgresql+asyncpg://"))
        try:
            async with AsyncSession(engine) as session, session.begin():
                async def run(sql: str) -> None:
                    await session.execute(text(sql))
                yield session, run
        finally:
            await engine.dispose()
    return tx


def _sqlalchemy_sync(url: str) -> Tx:
    pytest.importorskip("sqlalchemy", reason="SQLAlchemy is in the test extra")
    pytest.importorskip("psycopg", reason="psycopg 3 is in the test extra")
    from sqlalchemy import create_engine, text  # noqa: PLC0415

    @asynccontextmanager
    async def tx() -> AsyncIterator[tuple[Any, Callable[[str], Awaitable[None]]]]:
        engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
        try:
            with engine.begin() as conn:
                async def run(sql: str) -> None:
                    conn.execute(text(sql))
                yield conn, run
        finally:
            engine.dispose()
    return tx


DRIVERS = {"asyncpg": _asyncpg, "psycopg": _psycopg_async, "psycopg-sync": _psycopg_sync,
           "sqlalchemy": _sqlalchemy_async, "sqlalchemy-sync": _sqlalchemy_sync}


@pytest.fixture(params=list(DRIVERS))
def tx(request: pytest.FixtureRequest, database_url: str) -> Tx:
    return DRIVERS[request.param](database_url)


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, workflows.registry) as e:
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute("CREATE TABLE orders (id text PRIMARY KEY)")
        finally:
            await conn.close()
        yield e


async def _count(url: str, sql: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return int(await conn.fetchval(sql))
    finally:
        await conn.close()


async def test_start_commits_and_rolls_back_with_the_caller(engine: Engine, tx: Tx, database_url: str) -> None:
    async with tx() as (conn, run):
        await run("INSERT INTO orders VALUES ('o-1')")
        iid = await engine.client.start(report, {"kind": "o-1"}, connection=conn)
        await engine.run_until_idle()  # not committed yet: nothing to run, nothing visible
        assert await _count(database_url, "SELECT count(*) FROM stepstone.instances") == 0
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"

    with contextlib.suppress(Rollback):  # the block always ends by raising it: a rollback
        async with tx() as (conn, run):
            await run("INSERT INTO orders VALUES ('o-2')")
            await engine.client.start(report, {"kind": "o-2"}, connection=conn)
            raise Rollback
    await engine.run_until_idle()
    assert await _count(database_url, "SELECT count(*) FROM orders") == 1
    assert await _count(database_url, "SELECT count(*) FROM stepstone.instances") == 1
    assert await _count(database_url, "SELECT count(*) FROM stepstone.commands") == 1


async def test_signal_commits_and_rolls_back_with_the_caller(engine: Engine, tx: Tx) -> None:
    iid = await engine.client.start(long, {})
    await engine.run_until_idle()
    with contextlib.suppress(Rollback):  # the block always ends by raising it: a rollback
        async with tx() as (conn, run):
            await run("INSERT INTO orders VALUES ('paid')")
            await engine.client.signal(iid, "done", {"by": "rolled back"}, connection=conn)
            raise Rollback
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "WAITING"
    async with tx() as (conn, run):
        await run("INSERT INTO orders VALUES ('paid')")
        await engine.client.signal(iid, "done", connection=conn)
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"


async def test_a_refused_start_leaves_the_callers_transaction_usable(engine: Engine, tx: Tx, database_url: str) -> None:
    holder = await engine.client.start(long, {}, business_key="k-1")
    async with tx() as (conn, run):
        with pytest.raises(BusinessKeyInUse) as refused:
            await engine.client.start(long, {}, business_key="k-1", connection=conn)
        assert refused.value.instance_id == holder
        await run("INSERT INTO orders VALUES ('after')")  # the transaction goes on
        again = await engine.client.start(long, {}, idempotency_key="i-1", connection=conn)
        assert await engine.client.start(long, {}, idempotency_key="i-1", connection=conn) == again
    assert await _count(database_url, "SELECT count(*) FROM orders") == 1
    assert (await engine.client.get(again)).status == "PENDING"


async def test_an_unknown_connection_is_refused_in_one_line(engine: Engine) -> None:
    with pytest.raises(InvalidInput, match="connection= takes an asyncpg or psycopg 3 connection"):
        await engine.client.start(report, {}, connection=object())
