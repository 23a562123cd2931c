"""Start, signal and publish inside the caller's own transaction: the instance exists exactly when the caller's
business write commits, and not at all when it rolls back; with every supported driver."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import asyncpg
import pytest

from stepstone.errors import BusinessKeyInUse, InvalidInput, OpenSignalLimit, SchemaNotReady
from stepstone.testing import Engine, open_engine
from tests._pg import PgServer, until_shown, until_waiting_for_a_lock
from tests.scheduling import workflows
from tests.scheduling.workflows import long, parcel, report

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


async def test_publish_commits_and_rolls_back_with_the_caller(engine: Engine, tx: Tx, database_url: str) -> None:
    waiting = await engine.client.start(parcel, {"customer": "c-1"})
    await engine.run_until_idle()
    with contextlib.suppress(Rollback):  # the block always ends by raising it: a rollback
        async with tx() as (conn, run):
            await run("INSERT INTO orders VALUES ('shipped')")
            published = await engine.client.publish_message("arrived", "c-1", {"n": 1}, connection=conn)
            assert published.outcome == "delivered" and published.deliveries[0].instance_id == waiting
            raise Rollback
    await engine.run_until_idle()
    assert (await engine.client.get(waiting)).status == "WAITING"
    assert await _count(database_url, "SELECT count(*) FROM stepstone.messages") == 0
    assert await _count(database_url, "SELECT count(*) FROM stepstone.commands WHERE kind = 'MESSAGE'") == 0

    async with tx() as (conn, run):
        await run("INSERT INTO orders VALUES ('shipped')")
        published = await engine.client.publish_message("arrived", "c-1", {"n": 2}, connection=conn)
        assert published.outcome == "delivered"
        # Not committed yet: another session sees neither the message nor its command.
        assert await _count(database_url, "SELECT count(*) FROM stepstone.messages") == 0
    await engine.run_until_idle()
    info = await engine.client.get(waiting)
    assert info.status == "COMPLETED" and info.state["data"]["got"] == {"n": 2}


async def test_a_buffered_publish_is_kept_only_when_the_caller_commits(engine: Engine, tx: Tx) -> None:
    with contextlib.suppress(Rollback):
        async with tx() as (conn, _run):
            kept = await engine.client.publish_message("arrived", "c-rolled", {"n": 1}, ttl=3600, connection=conn)
            assert kept.outcome == "buffered" and kept.expires_at is not None
            raise Rollback
    async with tx() as (conn, _run):
        kept = await engine.client.publish_message("arrived", "c-kept", {"n": 2}, ttl=3600, message_id="m-1",
                                                   connection=conn)
        assert kept.outcome == "buffered"
    async with tx() as (conn, _run):  # the same message id, committed before: the earlier answer
        again = await engine.client.publish_message("arrived", "c-kept", {"n": 2}, ttl=3600, message_id="m-1",
                                                    connection=conn)
        assert again.duplicate and again.outcome == "buffered"
    rolled = await engine.client.start(parcel, {"customer": "c-rolled"})
    committed = await engine.client.start(parcel, {"customer": "c-kept"})
    await engine.run_until_idle()
    assert (await engine.client.get(rolled)).status == "WAITING"
    info = await engine.client.get(committed)
    assert info.status == "COMPLETED" and info.state["data"]["got"] == {"n": 2}


async def test_a_refused_publish_leaves_the_callers_transaction_usable(
    engine: Engine, tx: Tx, database_url: str,
) -> None:
    waiting = await engine.client.start(parcel, {"customer": "c-full"})
    await engine.run_until_idle()
    async with tx() as (conn, run):
        await run("SELECT set_config('stepstone.max_open_signals', '0', true)")  # this transaction: no room
        with pytest.raises(OpenSignalLimit, match="open signals and messages"):
            await engine.client.publish_message("arrived", "c-full", {"n": 1}, connection=conn)
        await run("INSERT INTO orders VALUES ('after')")  # the transaction goes on
    assert await _count(database_url, "SELECT count(*) FROM orders") == 1
    assert await _count(database_url, "SELECT count(*) FROM stepstone.commands WHERE kind = 'MESSAGE'") == 0
    assert (await engine.client.get(waiting)).status == "WAITING"


async def test_a_publish_waits_out_a_busy_instance_inside_the_callers_transaction(
    engine: Engine, database_url: str,
) -> None:
    waiting = await engine.client.start(parcel, {"customer": "c-busy"})
    await engine.run_until_idle()
    holder = await asyncpg.connect(database_url)  # stands for a worker committing this instance
    try:
        async with _asyncpg(database_url)() as (conn, run):
            locked = holder.transaction()
            await locked.start()
            await holder.execute("SELECT 1 FROM stepstone.instances WHERE id = $1 FOR UPDATE", waiting)
            publishing = asyncio.ensure_future(
                engine.client.publish_message("arrived", "c-busy", {"n": 1}, connection=conn))
            # The publish waits in the database, not in the client: its one statement is seen waiting for
            # the held row on its backend (migration 0075: before the correlation key's lock, as a signal
            # waits; it slept between NOWAIT attempts before). A client retrying would sleep on its own
            # side and send a new statement for each attempt.
            await until_shown(holder, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                              "AND state = 'active' AND wait_event_type = 'Lock' "
                              "AND query LIKE '%publish_in_caller_transaction%' AND pid <> pg_backend_pid()",
                              failure="the publish never waited in its statement")
            assert not publishing.done(), publishing
            await locked.commit()
            assert (await publishing).outcome == "delivered"
            await run("INSERT INTO orders VALUES ('after')")
    finally:
        await holder.close()
    await engine.run_until_idle()
    assert (await engine.client.get(waiting)).status == "COMPLETED"
    assert await _count(database_url, "SELECT count(*) FROM orders") == 1


@pytest.mark.parametrize("driver", list(DRIVERS))
async def test_the_callers_own_mistakes_are_named_with_every_driver(
    engine: Engine, driver: str, database_url: str, pg_server: PgServer,
) -> None:
    """A connection to a database stepstone has not migrated was the driver's 'schema "stepstone" does not
    exist'; a transaction an earlier statement aborted was its 'current transaction is aborted'."""
    with contextlib.suppress(Rollback):
        async with DRIVERS[driver](pg_server.url_for("postgres"))() as (conn, _):
            with pytest.raises(SchemaNotReady, match="not set up on the connection given"):
                await engine.client.start(report, {}, connection=conn)
            raise Rollback
    with contextlib.suppress(Rollback):
        async with DRIVERS[driver](database_url)() as (conn, run):
            with contextlib.suppress(Exception):
                await run("SELECT 1/0")
            with pytest.raises(InvalidInput, match="transaction is aborted"):
                await engine.client.start(report, {}, connection=conn)
            raise Rollback
    assert await _count(database_url, "SELECT count(*) FROM stepstone.instances") == 0


async def test_a_sync_connections_statement_leaves_the_loop_to_other_tasks(engine: Engine, database_url: str) -> None:
    """The async Client given a sync connection ran its statement on the caller's event loop: while it waited
    for a lock, no other task of that loop ran (here, until the lock's holder gave up waiting for one)."""
    psycopg = pytest.importorskip("psycopg", reason="psycopg 3 is in the test extra")
    locked, loop_ran = threading.Event(), threading.Event()
    with psycopg.connect(database_url, autocommit=True) as blocker, psycopg.connect(database_url) as caller:
        pid = caller.info.backend_pid

        def hold_the_lock() -> None:
            with blocker.transaction():
                blocker.execute("LOCK TABLE stepstone.instances IN SHARE MODE")  # the start's insert waits
                locked.set()
                asyncio.run(until_waiting_for_a_lock(database_url, pid))
                loop_ran.wait(timeout=20)  # a loop the statement holds never sets it

        holder = threading.Thread(target=hold_the_lock)
        holder.start()
        await asyncio.to_thread(locked.wait)
        with caller.transaction():
            caller.execute("INSERT INTO orders VALUES ('o-1')")
            starting = asyncio.ensure_future(engine.client.start(report, {}, connection=caller))
            await asyncio.to_thread(asyncio.run, until_waiting_for_a_lock(database_url, pid))
            ran_while_it_waited = not starting.done()  # this task ran on the loop meanwhile
            loop_ran.set()
            instance_id = await starting
            assert caller.execute("SELECT count(*) FROM orders").fetchone() == (1,)  # the transaction goes on
        await asyncio.to_thread(holder.join)
    assert ran_while_it_waited, "the loop ran no other task while the statement waited for its lock"
    assert (await engine.client.get(instance_id)).status == "PENDING"  # committed with the caller's order
    assert await _count(database_url, "SELECT count(*) FROM orders") == 1


@pytest.mark.parametrize("driver", ["psycopg-sync", "sqlalchemy-sync"])
async def test_a_cancelled_call_on_a_sync_connection_ends_its_statement_first(
    engine: Engine, database_url: str, driver: str,
) -> None:
    """Cancelled while its statement waits for a lock, the call ends once the statement has: cancelled on
    the server (the caller's transaction is aborted, as with an async driver), not left running in its
    thread behind the caller's back."""
    psycopg = pytest.importorskip("psycopg", reason="psycopg 3 is in the test extra")
    from psycopg.pq import TransactionStatus  # noqa: PLC0415

    with psycopg.connect(database_url, autocommit=True) as blocker, contextlib.suppress(Rollback):
        async with DRIVERS[driver](database_url)() as (conn, run):
            raw = conn if driver == "psycopg-sync" else conn.connection.dbapi_connection
            with blocker.transaction():
                blocker.execute("LOCK TABLE stepstone.instances IN SHARE MODE")
                await run("INSERT INTO orders VALUES ('o-1')")
                starting = asyncio.ensure_future(engine.client.start(report, {}, connection=conn))
                await until_waiting_for_a_lock(database_url, raw.info.backend_pid)
                starting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await starting
                status = raw.info.transaction_status  # ACTIVE while a statement runs on it
            raise Rollback
    assert status == TransactionStatus.INERROR
    assert await _count(database_url, "SELECT count(*) FROM stepstone.instances") == 0
    assert await _count(database_url, "SELECT count(*) FROM orders") == 0
