"""The store's one-statement calls run on one connection kept out of the pool (store/kept_connection.py),
and fall back to the pool whenever that connection is busy, failed or was cut."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from stepstone.store.kept_connection import KeptConnection

PID = "SELECT pg_backend_pid()"
RUNNING = ("SELECT EXISTS (SELECT 1 FROM pg_stat_activity "
           "WHERE pid = $1 AND state = 'active' AND query LIKE '%pg_sleep(30)%')")


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    async def no_reset(conn: asyncpg.Connection) -> None:  # as the store's pool: no reset query
        if conn.is_in_transaction():
            await conn.reset()

    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=3, reset=no_reset)
    try:
        yield pool
    finally:
        await asyncio.wait_for(pool.close(), timeout=10)


async def test_calls_one_after_another_run_on_one_connection_the_pool_does_not_hand_out(pool: asyncpg.Pool) -> None:
    kept = KeptConnection(pool)
    pids = {await kept.fetchval(PID) for _ in range(20)}
    assert len(pids) == 1
    async with pool.acquire() as other:  # the pool hands out another: the kept one is not in it
        assert await other.fetchval(PID) not in pids
    assert [r[0] for r in await kept.fetch("SELECT generate_series(1, 3)")] == [1, 2, 3]
    assert (await kept.fetchrow("SELECT 7 AS n"))["n"] == 7  # type: ignore[index]
    await kept.close()


async def test_a_call_made_while_the_kept_connection_is_busy_goes_through_the_pool(pool: asyncpg.Pool) -> None:
    kept = KeptConnection(pool)
    first = await kept.fetchval(PID)
    both = await asyncio.gather(kept.fetchval("SELECT pg_backend_pid() FROM pg_sleep(0.2)"), kept.fetchval(PID))
    assert both[0] == first and both[1] != first
    assert await kept.fetchval(PID) == first  # and the next call is on the kept one again
    await kept.close()


async def test_after_an_error_the_connection_goes_back_to_the_pool_and_the_next_call_works(
        pool: asyncpg.Pool) -> None:
    kept = KeptConnection(pool)
    await kept.fetchval(PID)
    with pytest.raises(asyncpg.DivisionByZeroError):
        await kept.fetchval("SELECT 1 / 0")
    assert pool.get_idle_size() >= 1  # handed back, not held
    assert await kept.fetchval("SELECT 2") == 2
    await kept.close()


async def test_a_cancelled_call_gives_its_connection_back_and_leaves_nothing_running(pool: asyncpg.Pool) -> None:
    kept = KeptConnection(pool)
    pid = await kept.fetchval(PID)
    call = asyncio.create_task(kept.fetchval("SELECT pg_sleep(30)"))
    async with pool.acquire() as probe:  # cancel once the server is running it
        while not await probe.fetchval(RUNNING, pid):
            pass
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await kept.fetchval("SELECT 3") == 3
    async with pool.acquire() as probe:
        assert not await probe.fetchval(RUNNING, pid)
    await kept.close()


async def test_a_kept_connection_cut_while_idle_is_replaced_before_the_next_call(
        pool: asyncpg.Pool, database_url: str) -> None:
    kept = KeptConnection(pool)
    pid = await kept.fetchval(PID)
    cut = asyncio.Event()
    assert kept._idle is not None
    kept._idle.add_termination_listener(lambda _conn: cut.set())  # the driver's own signal that it was cut
    admin = await asyncpg.connect(database_url)
    try:
        assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
    finally:
        await admin.close()
    await asyncio.wait_for(cut.wait(), timeout=10)
    new = await kept.fetchval(PID)  # no error: the cut connection was not used
    assert new != pid
    await kept.close()


async def test_close_gives_the_kept_connection_back_so_the_pool_can_close(database_url: str) -> None:
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    kept = KeptConnection(pool)
    await kept.fetchval(PID)
    await kept.close()
    await asyncio.wait_for(pool.close(), timeout=10)  # waits forever for a connection not given back
    assert pool.is_closing()


async def test_calls_that_arrive_together_before_any_is_kept_keep_one_and_leak_none(database_url: str) -> None:
    pool = await asyncpg.create_pool(database_url, min_size=0, max_size=4)  # the first acquire has to connect
    try:
        kept = KeptConnection(pool)
        await asyncio.gather(*(kept.fetchval("SELECT pg_sleep(0.05)") for _ in range(3)))
        await kept.fetchval(PID)
        await kept.close()
        assert pool.get_idle_size() == pool.get_size()  # every connection is back in the pool
    finally:
        pool.terminate()
