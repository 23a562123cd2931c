"""`until_blocked`, how tests see that a session began to wait for a lock they hold. The server's lock views show
every database's sessions: under pytest-xdist the other test processes share the server and wait for locks of
their own, which a count of all waiting sessions took for the awaited one."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from tests._pg import until_blocked


async def test_only_a_wait_for_the_holders_lock_is_counted(empty_database_url: str) -> None:
    conns = [await asyncpg.connect(empty_database_url) for _ in range(6)]
    looker, elsewhere_holder, holder, *waiters = conns
    try:
        await elsewhere_holder.execute("SELECT pg_advisory_lock(7001, 1)")
        await holder.execute("SELECT pg_advisory_lock(7001, 2)")
        # Two sessions wait for another lock, as another test's would: nothing waits for the holder yet.
        elsewhere = [asyncio.ensure_future(w.execute("SELECT pg_advisory_lock_shared(7001, 1)")) for w in waiters[:2]]
        await until_blocked(looker, elsewhere_holder, 2)
        with pytest.raises(AssertionError, match="no session came to wait"):
            await until_blocked(looker, holder, timeout=0.2)
        mine = asyncio.ensure_future(waiters[2].execute("SELECT pg_advisory_lock(7001, 2)"))
        await until_blocked(looker, holder, 1)
        with pytest.raises(AssertionError, match="no session came to wait"):
            await until_blocked(looker, holder, 2, timeout=0.2)
        assert not mine.done()
        await holder.execute("SELECT pg_advisory_unlock(7001, 2)")
        await elsewhere_holder.execute("SELECT pg_advisory_unlock(7001, 1)")
        await asyncio.wait_for(mine, 10)
        await asyncio.wait_for(asyncio.gather(*elsewhere), 10)
    finally:
        for conn in conns:
            conn.terminate()
