"""One pool connection kept out of the pool for the store's one-statement calls.

asyncpg's `Pool.fetch` acquires a connection, runs the statement and releases it, and the release
goes through `asyncio.shield`, a task of its own that runs in a later pass of the event loop. That is
about 40 µs of CPU and 40 µs of waiting on every statement of the hot path (one-at-a-time `SELECT 1`
here: 135-150 µs a call through the pool against 95-106 µs on the connection; docs/performance-history.md, "A
connection kept out of the pool"). The store's calls come one at a time more often than not (the
group committer sends one commit statement at a time, a lone caller starts one instance at a time),
so the first call takes a connection from the pool and keeps it; the next call that finds it idle runs
on it directly, and a call that finds it busy goes through the pool as before. At most one connection
is kept, and `PostgresStore.open` makes the pool one connection larger for it, so the calls that go
through the pool have as many connections as before, and a transaction never waits behind a kept one
sitting idle.

A connection is kept again only after a statement that succeeded; after any error (a unique
violation as much as a cut connection or a cancelled call) it goes back to the pool, whose release
resets it or, when it was cut, ends it; and one found closed while idle goes back before the call,
for the pool's next acquire to connect anew.
"""

from __future__ import annotations

from typing import Any

import asyncpg
from asyncpg.pool import PoolConnectionProxy


class KeptConnection:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self._idle: PoolConnectionProxy[Any] | None = None
        self._kept = False  # a connection is kept (idle, or running a call)
        self._closing = False

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        return await self._run("fetch", sql, args)  # type: ignore[no-any-return]

    async def fetchrow(self, sql: str, *args: Any) -> asyncpg.Record | None:
        return await self._run("fetchrow", sql, args)  # type: ignore[no-any-return]

    async def fetchval(self, sql: str, *args: Any) -> Any:
        return await self._run("fetchval", sql, args)

    async def _run(self, method: str, sql: str, args: tuple[Any, ...]) -> Any:
        conn, self._idle = self._idle, None
        if conn is not None and not _usable(conn):  # cut while idle: the pool's next acquire connects anew
            self._kept = False
            await self.pool.release(conn)  # (nothing to do when the driver gave it back itself)
            conn = None
        if conn is None:
            if self._kept or self._closing:  # the kept one is busy: the pool serves this call
                return await getattr(self.pool, method)(sql, *args)
            self._kept = True  # before the await: a call arriving meanwhile must not acquire one too
            try:
                conn = await self.pool.acquire()
            except BaseException:
                self._kept = False
                raise
        return await self._on(conn, method, sql, args)

    async def _on(self, conn: PoolConnectionProxy[Any], method: str, sql: str, args: tuple[Any, ...]) -> Any:
        try:
            result = await getattr(conn, method)(sql, *args)
        except BaseException:
            self._kept = False
            await self.pool.release(conn)  # the pool resets it, or ends it when it was cut
            raise
        if self._closing or conn.is_in_transaction():
            self._kept = False
            await self.pool.release(conn)
        else:
            self._idle = conn
        return result

    async def close(self) -> None:
        """Give the kept connection back to the pool (before the pool closes, which waits for it)."""
        self._closing = True
        conn, self._idle = self._idle, None
        if conn is not None:
            self._kept = False
            await self.pool.release(conn)


def _usable(conn: PoolConnectionProxy[Any]) -> bool:
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:  # the driver gave a cut connection back to the pool itself
        return False
