"""PostgreSQL for the test suite: one server per session, one database per test cloned from a template.

The server is ``STEPSTONE_TEST_DATABASE_URL`` when set, else an embedded server in a temp dir (with
``fsync=off``, for tests only). Admin work runs on a private event loop in a background thread so it
never touches the loop pytest-asyncio gives each test.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import tempfile
import threading
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from stepstone.config import quote_ident
from stepstone.store import embedded
from stepstone.store.migrate import migrate

T = TypeVar("T")

TEST_URL_ENV = "STEPSTONE_TEST_DATABASE_URL"
SCHEMA = "stepstone"


def url_for(url: str, database: str, *, user: str | None = None) -> str:
    """``url`` pointing at another database (and optionally as another user, without password)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if user is not None:
        netloc = f"{user}@{netloc.rpartition('@')[2]}"
    return urlunsplit((parts.scheme, netloc, f"/{database}", parts.query, parts.fragment))


class AdminLoop:
    """A background event loop holding one admin connection to the server."""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pg-admin", daemon=True)
        self._thread.start()
        self._lock = asyncio.Lock()  # one admin statement at a time on the shared connection
        self.conn: asyncpg.Connection = self.run(asyncpg.connect(admin_url))

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the admin loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the admin loop without waiting."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def locked(self, fn: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        async with self._lock:
            return await fn(self.conn)

    def call(self, fn: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        """Run ``fn(admin_connection)`` on the admin loop."""
        return self.run(self.locked(fn))

    def close(self) -> None:
        self.run(self.conn.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@dataclass
class PgServer:
    """The session's PostgreSQL server."""

    admin_url: str
    embedded: bool
    pgdata: Path | None
    bin_dir: Path
    server_version_num: int
    admin: AdminLoop
    template: str = ""
    # Measured on the 2-core reference machine (create + drop of a tiny clone): FILE_COPY 67 ms vs
    # WAL_LOG 76 ms on a durable server, but WAL_LOG 35 ms vs FILE_COPY 75 ms with fsync=off, where
    # FILE_COPY's two checkpoints dominate. None means the server's default (WAL_LOG on 15+).
    clone_strategy: str | None = None
    _next_clone: concurrent.futures.Future[str] | None = field(default=None, repr=False)
    _drops: list[concurrent.futures.Future[str]] = field(default_factory=list, repr=False)

    def url_for(self, database: str, *, user: str | None = None) -> str:
        return url_for(self.admin_url, database, user=user)

    def _create_sql(self, template: str | None, prefix: str) -> tuple[str, str]:
        name = f"stepstone_{prefix}_{uuid.uuid4().hex[:12]}"
        sql = f"CREATE DATABASE {quote_ident(name)}"
        if template:
            sql += f" TEMPLATE {quote_ident(template)}"
            if self.clone_strategy and self.server_version_num >= 150000:
                sql += f" STRATEGY = {self.clone_strategy}"
        return name, sql

    def create_database(self, *, template: str | None = None, prefix: str = "t") -> str:
        """Create a uniquely named database (cloned from ``template`` if given); return its name."""
        name, sql = self._create_sql(template, prefix)
        self.admin.call(lambda c: c.execute(sql))
        return name

    def take_clone(self) -> str:
        """A fresh clone of the template; the next one is created in the background meanwhile."""
        ready = self._next_clone
        name, sql = self._create_sql(self.template, "t")

        async def create() -> str:
            await self.admin.locked(lambda c: c.execute(sql))
            return name

        self._next_clone = self.admin.submit(create())
        if ready is None:
            return self.create_database(template=self.template)
        return ready.result()

    def discard_prepared(self) -> None:
        """Drop the clone prepared in advance, if any."""
        if self._next_clone is not None:
            self.drop_database(self._next_clone.result())
            self._next_clone = None

    def drop_database(self, name: str, *, template: bool = False) -> None:
        if template:
            self.execute(f"ALTER DATABASE {quote_ident(name)} WITH IS_TEMPLATE false")
        self.admin.call(lambda c: c.execute(self._drop_sql(name)))

    def drop_later(self, name: str) -> None:
        """Drop a test's database on the admin loop while the next test runs (on a durable server a
        drop takes about 0.1 s; a test waiting for it was 10-15% of the suite). `finish_drops` waits for
        them and says which failed."""
        sql = self._drop_sql(name)
        self._drops = [f for f in self._drops if not f.done() or f.exception() is not None]
        self._drops.append(self.admin.submit(self.admin.locked(lambda c: c.execute(sql))))

    def finish_drops(self) -> None:
        drops, self._drops = self._drops, []
        failed = [str(f.exception()) for f in drops if f.exception() is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} test database(s) could not be dropped: {failed[0]}")

    def _drop_sql(self, name: str) -> str:
        force = " WITH (FORCE)" if self.server_version_num >= 130000 else ""
        return f"DROP DATABASE IF EXISTS {quote_ident(name)}{force}"

    def execute(self, sql: str, *args: Any) -> str:
        """Run one admin statement on the server's admin database."""
        return self.admin.call(lambda c: c.execute(sql, *args))


def start_server() -> tuple[PgServer, Callable[[], None]]:
    """Start (or connect to) the session's server; return it and its cleanup."""
    configured = os.environ.get(TEST_URL_ENV)
    cleanups: list[Callable[[], None]] = []
    if configured:
        admin_url, pgdata, is_embedded = configured, None, False
    else:
        pgdata = Path(tempfile.mkdtemp(prefix="stepstone-test-")) / "pg"
        try:
            server = embedded.ensure_server(pgdata, announce=False)
        except BaseException:
            _stop_embedded(pgdata)  # a server that failed to start leaves its data dir: tests stop what they start
            raise
        admin_url, is_embedded = server.uri, True
        cleanups.append(lambda: _stop_embedded(server.pgdata))
    admin = AdminLoop(admin_url)
    cleanups.insert(0, admin.close)
    version = int(admin.call(lambda c: c.fetchval("SHOW server_version_num")))
    if is_embedded:
        # Tests only: durability is irrelevant for throwaway databases, and fsync dominates DDL time.
        admin.call(lambda c: c.execute("ALTER SYSTEM SET fsync = off"))
        admin.call(lambda c: c.execute("SELECT pg_reload_conf()"))
    pg = PgServer(
        admin_url=admin_url,
        embedded=is_embedded,
        pgdata=pgdata,
        bin_dir=embedded.pg_bin_dir(),
        server_version_num=version,
        admin=admin,
        clone_strategy=None if is_embedded else "FILE_COPY",
    )
    pg.template = pg.create_database(prefix="tmpl")
    cleanups.insert(0, lambda: pg.drop_database(pg.template, template=True))
    cleanups.insert(0, pg.discard_prepared)
    cleanups.insert(0, pg.finish_drops)

    async def migrate_template() -> None:
        conn = await asyncpg.connect(pg.url_for(pg.template))
        try:
            await migrate(conn, SCHEMA)
        finally:
            await conn.close()

    admin.run(migrate_template())
    # Nobody (autovacuum included) may connect to the template, or every clone waits for it to leave.
    pg.execute(f"ALTER DATABASE {quote_ident(pg.template)} WITH IS_TEMPLATE true ALLOW_CONNECTIONS false")

    def cleanup() -> None:
        for fn in cleanups:
            fn()

    return pg, cleanup


def _stop_embedded(pgdata: Path) -> None:
    """Stop the server of a throwaway data dir and delete it (the session's, or a test's own)."""
    import contextlib  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    from stepstone.errors import ConfigError  # noqa: PLC0415

    with contextlib.suppress(ConfigError):  # a copied data dir: the server it names is not its own
        embedded.stop_server(pgdata, mode="immediate")
    shutil.rmtree(pgdata.parent, ignore_errors=True)


async def until_shown(conn: asyncpg.Connection, query: str, *args: Any, every: float = 0.01, timeout: float = 30.0,
                      failure: str = "the server never showed it") -> Any:
    """The first true value of `query` on `conn`, looked at every `every` seconds (bounded by `timeout`).

    For what PostgreSQL tells no one about: that a session began to wait for a lock, that a statement is
    running or sleeping. pg_stat_activity and pg_locks are looked at until they show it; each look takes
    a fresh snapshot of the statistics (pg_stat_clear_snapshot)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        value = await conn.fetchval(query, *args)
        if value:
            return value
        assert asyncio.get_running_loop().time() < deadline, failure
        await asyncio.sleep(every)


async def until_waiting_for_a_lock(database_url: str, pid: int) -> None:
    """Until the backend `pid` waits for a lock (a statement on the caller's connection, held up on purpose)."""
    conn = await asyncpg.connect(database_url)
    try:
        await until_shown(conn, "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid,
                          failure="the start in the caller's transaction never waited for the lock")
    finally:
        await conn.close()


async def until_blocked(conn: asyncpg.Connection, holder: asyncpg.Connection, count: int = 1, *,
                        every: float = 0.01, timeout: float = 30.0,
                        failure: str = "no session came to wait for the held lock") -> None:
    """Until `count` sessions wait for a lock that `holder` holds (pg_blocking_pids names it), looked at on `conn`.

    Only waits on `holder` count: pg_locks and pg_stat_activity show the whole server, and under pytest-xdist
    the other test processes' sessions on a shared server wait for locks of their own."""
    await until_shown(conn, "SELECT count(*) >= $2 FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                      holder.get_server_pid(), count, every=every, timeout=timeout, failure=failure)
