"""Start, signal and publish on the caller's own connection, inside its transaction, whatever its driver.

    async with conn.transaction():                      # the caller's asyncpg transaction
        await conn.execute("INSERT INTO orders ...")
        await client.start(order_flow, {...}, connection=conn)
    # committed together; rolled back together

Accepted: an asyncpg connection, a psycopg 3 connection (async or sync), a SQLAlchemy connection or
session (async or sync). The statement is one call of a store function, so the instance, its START
command and its history row are written by the caller's transaction and become visible (and wake the
workers, whose NOTIFY is sent at commit) exactly when it commits; a rollback leaves nothing. A publish
delivers (or buffers) its message the same way: the MESSAGE command and the message row are the caller's
writes. A refusal (a key in use, an instance's open-signal cap, a matching instance that stays busy)
is an answer of the statement, not an error, so the caller's transaction stays usable after it. A sync
connection's statement runs in a worker thread (`_fetched_in_a_thread`), never on an event loop.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from typing import Any, Protocol, runtime_checkable

from stepstone.errors import InvalidInput, OpenSignalLimit, SchemaNotReady, Unavailable
from stepstone.store.outcomes import signal_command_id, start_result
from stepstone.store.port import NewInstance
from stepstone.store.queries import named_queries

__all__ = ["ASYNC_DRIVERS", "CallerTransactionQueries", "CallerTransactionStore", "driver_of"]

_PARAM = re.compile(r"\$(\d+)")


ASYNC_DRIVERS = frozenset({"asyncpg", "psycopg", "sqlalchemy"})
"""The drivers of `driver_of` whose connections belong to an event loop."""


def driver_of(connection: Any) -> str:
    """'asyncpg', 'psycopg', 'psycopg-sync', 'sqlalchemy' or 'sqlalchemy-sync' (by the object's type)."""
    module = type(connection).__module__
    name = type(connection).__name__
    if module.startswith("asyncpg"):
        return "asyncpg"
    if module.startswith("psycopg"):
        return "psycopg" if name.startswith("Async") else "psycopg-sync"
    if module.startswith("sqlalchemy"):
        return "sqlalchemy" if module.startswith("sqlalchemy.ext.asyncio") else "sqlalchemy-sync"
    raise InvalidInput(
        f"connection= takes an asyncpg or psycopg 3 connection or a SQLAlchemy connection or session, "
        f"not {module}.{name}", what="connection")


_NO_SCHEMA = {"3F000", "42P01", "42883"}  # invalid schema name, undefined table, undefined function
_ABORTED = "25P02"  # in_failed_sql_transaction


async def _rows(connection: Any, sql: str, args: list[str | None]) -> list[dict[str, Any]]:
    """The rows of one store statement on the caller's connection. Two of the caller's own mistakes are
    named, whichever driver raised them: a connection to a database (or schema) that stepstone has not
    migrated, and a transaction an earlier statement already aborted. Any other error is the driver's own,
    as the caller's code around it expects."""
    try:
        return await _fetched(connection, sql, args)
    except Exception as exc:
        state = _sqlstate(exc)
        if state in _NO_SCHEMA:
            raise SchemaNotReady(f"the stepstone schema is not set up on the connection given ({exc}): pass a "
                                 "connection to the database stepstone uses, or migrate that one", schema=None) from exc
        if state == _ABORTED:
            raise InvalidInput("the connection's transaction is aborted (an earlier statement in it failed): roll "
                               "it back first", what="connection") from exc
        raise


def _sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of an asyncpg or psycopg error, or of the one a SQLAlchemy error wraps."""
    for candidate in (exc, getattr(exc, "orig", None)):
        state = getattr(candidate, "sqlstate", None) or getattr(candidate, "pgcode", None)
        if isinstance(state, str):
            return state
    return None


async def _fetched(connection: Any, sql: str, args: list[str | None]) -> list[dict[str, Any]]:
    driver = driver_of(connection)
    if driver == "asyncpg":
        return [dict(r) for r in await connection.fetch(sql, *args)]
    if driver == "psycopg":
        cursor = connection.cursor()
        try:
            await cursor.execute(_psycopg_text(sql), args)
            fetched = await cursor.fetchall()
            names = [d.name for d in cursor.description or ()]
        finally:
            await cursor.close()
        return [dict(zip(names, row, strict=True)) for row in fetched]
    if driver == "sqlalchemy":
        result = await connection.execute(*_sqlalchemy_statement(sql, args))
        return [dict(row) for row in result.mappings().all()]
    return await _fetched_in_a_thread(connection, driver, sql, args)


async def _fetched_in_a_thread(
    connection: Any, driver: str, sql: str, args: list[str | None],
) -> list[dict[str, Any]]:
    """A sync connection's statement, run in a worker thread: on the event loop it would stop every other task
    of that loop (or, on a SyncClient's loop thread, every other thread's call) for as long as it runs, and a
    statement waiting for a lock stops them until the lock's holder commits. The connection is still used by
    one statement at a time: psycopg (3 and 2) serializes the use of a connection with a lock of its own.

    The call does not end before the statement does. Cancelled meanwhile, it cancels the statement on the
    server, as asyncpg and psycopg's async connection do (the caller's transaction is then aborted, so nothing
    of the call can commit), and waits for it to end; a statement not sent yet is not sent. The caller's next
    use of the connection never finds it still at work. A cancel that reaches the server just after the
    statement ended finds nothing to cancel: its write is then in the caller's transaction, as with asyncpg
    (docs/integrations.md says to roll back after a cancelled call)."""
    statement = _Statement()
    running = asyncio.ensure_future(asyncio.to_thread(statement.run, connection, driver, sql, args))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        await statement.ended(running)
        raise


class _Statement:
    """One statement on a sync connection, run by `run` in a worker thread, and what stops it (`ended`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped = False
        self._on: Any = None  # the DB-API connection it runs on, once sent (what a cancel goes to)

    def run(self, connection: Any, driver: str, sql: str, args: list[str | None]) -> list[dict[str, Any]]:
        # A Session's connection (begun, as its execute would), or the Connection itself.
        bound = connection if driver == "psycopg-sync" or not callable(connection.connection) else (
            connection.connection())
        with self._lock:
            if self._stopped:
                raise asyncio.CancelledError
            self._on = bound if driver == "psycopg-sync" else getattr(bound.connection, "dbapi_connection", None)
        return _fetched_sync(connection, driver, sql, args)

    async def ended(self, running: asyncio.Future[Any]) -> None:
        """Cancel the statement on the server (or keep it from being sent) and wait for its thread to end,
        through any further cancellation of the waiting task (the call is cancelled already)."""
        with self._lock:
            self._stopped = True
            on = self._on
        cancel = getattr(on, "cancel_safe", None) or getattr(on, "cancel", None)
        waiting: set[asyncio.Future[Any]] = {running}
        if cancel is not None and not running.done():
            waiting.add(asyncio.ensure_future(asyncio.to_thread(cancel)))
        ended = set(waiting)
        while waiting:
            try:
                _, waiting = await asyncio.wait(waiting)
            except asyncio.CancelledError:
                continue
        for future in ended:  # the statement's error (QueryCanceled) and a failed cancel are the cancellation's
            if not future.cancelled():
                future.exception()


def _fetched_sync(connection: Any, driver: str, sql: str, args: list[str | None]) -> list[dict[str, Any]]:
    if driver == "psycopg-sync":
        with connection.cursor() as cursor:
            cursor.execute(_psycopg_text(sql), args)
            fetched = cursor.fetchall()
            names = [d.name for d in cursor.description or ()]
        return [dict(zip(names, row, strict=True)) for row in fetched]
    result = connection.execute(*_sqlalchemy_statement(sql, args))
    return [dict(row) for row in result.mappings().all()]


def _psycopg_text(sql: str) -> str:
    return _PARAM.sub("%s", sql.replace("%", "%%"))


def _sqlalchemy_statement(sql: str, args: list[str | None]) -> tuple[Any, dict[str, str | None]]:
    from sqlalchemy import text as sql_text  # noqa: PLC0415 - only callers that pass SQLAlchemy objects have it

    params = {f"p{n}": value for n, value in enumerate(args, start=1)}
    return sql_text(_PARAM.sub(lambda m: f":p{m.group(1)}", sql)), params


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@runtime_checkable
class CallerTransactionStore(Protocol):
    """What `Client.start(connection=...)` and `Client.signal(connection=...)` need from the store."""

    async def start_in(self, connection: Any, new: NewInstance) -> tuple[str, bool]: ...
    async def signal_in(
        self, connection: Any, instance_id: str, name: str, payload: Any, *, dedup_key: str | None,
        fingerprint: str, actor: str | None, position: str = "", context: Any = None,
    ) -> int: ...
    async def publish_in(
        self, connection: Any, name: str, correlation_key: str, payload: Any, *, message_id: str | None,
        ttl: float | None, correlate_all: bool, fingerprint: str,
    ) -> dict[str, Any]: ...


class CallerTransactionQueries:
    """`start_in`, `signal_in` and `publish_in`: the store's start, signal and publish, on the caller's
    connection."""

    schema: str

    def _cq(self, name: str) -> str:
        return named_queries("caller_transaction.sql", self.schema)[name]

    async def start_in(self, connection: Any, new: NewInstance) -> tuple[str, bool]:
        """Like `start`, on the caller's connection: (id, True) when created, (id, False) for a repeated key."""
        pin = new.pin
        args = [new.id, pin.scope, pin.definition_id, str(pin.version), pin.plan_hash,
                json.dumps(new.state, separators=(",", ":"), ensure_ascii=False), new.start_step, new.business_key,
                new.idempotency_key, new.fingerprint, new.actor, _json(new.context),
                None if new.deadline_at is None else new.deadline_at.isoformat(),
                None if new.deadline_seconds is None else repr(float(new.deadline_seconds)), new.start_step,
                None if new.start_deadline_seconds is None else repr(float(new.start_deadline_seconds))]
        [row] = await _rows(connection, self._cq("start"), args)
        return start_result(str(row["outcome"]), str(row["target"]), row["fingerprint"], key=new.idempotency_key,
                            business_key=new.business_key, expected=new.fingerprint)

    async def signal_in(
        self, connection: Any, instance_id: str, name: str, payload: Any, *, dedup_key: str | None,
        fingerprint: str, actor: str | None, position: str = "", context: Any = None,
    ) -> int:
        """Like `signal`, on the caller's connection: the signal's command id."""
        args = [instance_id, position, name, json.dumps(payload, separators=(",", ":"), ensure_ascii=False),
                dedup_key, fingerprint, _text(actor), _json(context)]
        [row] = await _rows(connection, self._cq("signal"), args)
        return signal_command_id(row, instance_id, name, dedup_key, position)

    async def publish_in(
        self, connection: Any, name: str, correlation_key: str, payload: Any, *, message_id: str | None,
        ttl: float | None, correlate_all: bool, fingerprint: str,
    ) -> dict[str, Any]:
        """Like `publish_message`, on the caller's connection: the same row (outcome, deliveries,
        expires_at, status); the cap and a busy instance raise here, with the transaction still usable."""
        args = [name, correlation_key, _json(payload), message_id, None if ttl is None else repr(float(ttl)),
                "true" if correlate_all else "false", fingerprint]
        [row] = await _rows(connection, self._cq("publish"), args)
        if row["outcome"] == "limit":
            raise OpenSignalLimit(str(row["detail"]).removeprefix("stepstone: ") + "; nothing was recorded",
                                  instance_id=None, limit=int(row["cap"] or 0))
        if row["outcome"] == "invalid":  # a ttl the client refuses too (migrations 0078, 0079)
            raise InvalidInput(str(row["detail"]).removeprefix("stepstone: "), what="ttl")
        if row["outcome"] == "busy":
            raise Unavailable(f"message {name!r} ({correlation_key!r}): the matching instance stayed busy; "
                              "nothing was published, try again")
        return {**row, "deliveries": json.loads(row["deliveries"])}
