"""Connecting to PostgreSQL and translating driver errors into the stepstone hierarchy.

Every asyncpg call that may fail for a reason a caller should tell apart (unreachable, privilege) runs
inside :func:`translate_errors` or goes through :func:`connect` / :func:`create_pool`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from stepstone.config import Settings
from stepstone.errors import (
    ClientClosed,
    DatabaseUnavailable,
    DefinitionDrift,
    InsufficientPrivilege,
    InvalidDatabaseUrl,
    InvalidInput,
    SchemaNotReady,
    StepstoneError,
    VersionNotAdmitted,
)
from stepstone.store import embedded
from stepstone.store.dsn import MASK, endpoint, malformed_reason, redact_url, secrets_in

__all__ = [
    "DatabaseTarget",
    "connect",
    "create_pool",
    "endpoint",
    "install_one_line_driver_logs",
    "redact_url",
    "resolve_target",
    "translate_errors",
]

DEFAULT_CONNECT_TIMEOUT = 10.0
log = logging.getLogger("stepstone.store")

# Every stepstone connection runs with JIT compilation off (sent at connect, so it survives the pool's
# RESET ALL and costs no round trip). The claim's plan does not know its batch size (hidden on purpose,
# see queries.sql), so with a million waiting instances its estimated cost passed jit_above_cost and
# PostgreSQL compiled it on every call: 57 ms an empty claim and 69 ms a claim, against 1.2 and 3.1 ms
# with a thousand waiting (`stepstone bench --only scale`, local PostgreSQL 15, JIT on by default).
# No statement of the engine reads enough rows to gain from compiling it. A caller's own
# `server_settings` win.
SESSION_SETTINGS = {"jit": "off"}


@dataclass(frozen=True)
class DatabaseTarget:
    """Where to connect: the URL, and the data dir when it is the embedded server."""

    url: str
    embedded: bool
    pgdata: Path | None = None


def resolve_target(settings: Settings, *, announce: bool = True) -> DatabaseTarget:
    """The configured database, or the embedded server (started or reused) when none is configured."""
    if settings.database_url:
        return DatabaseTarget(url=settings.database_url, embedded=False)
    server = embedded.ensure_server(announce=announce)
    return DatabaseTarget(url=server.uri, embedded=True, pgdata=server.pgdata)


def _scrub(text: str, url: str) -> str:
    """Remove the URL's password (and the URL itself) from a driver message; keep the first line."""
    first = text.splitlines()[0] if text else ""
    first = first.replace(url, redact_url(url)) if url else first
    for secret in secrets_in(url):
        first = first.replace(secret, MASK)
    return first


def _unavailable(url: str, reason: str) -> DatabaseUnavailable:
    host, port = endpoint(url)
    where = f"{host}:{port}" if port is not None else host
    message = f"cannot reach PostgreSQL at {where}: {_scrub(reason, url)}"
    return DatabaseUnavailable(message, host=host, port=port)


def _malformed(url: str, reason: str) -> InvalidDatabaseUrl:
    safe = redact_url(url)
    return InvalidDatabaseUrl(f"malformed database URL {safe!r}: {_scrub(reason, url)}", url=safe)


# The server refuses a URL query parameter it does not know (asyncpg sends them as settings).
_REFUSED_PARAMETER = (
    asyncpg.exceptions.UndefinedObjectError,
    asyncpg.exceptions.InvalidParameterValueError,
    asyncpg.exceptions.CantChangeRuntimeParamError,
)


def _check_url(url: str) -> None:
    reason = malformed_reason(url)
    if reason is not None:
        raise _malformed(url, reason)


def _unstorable_text(message: str) -> StepstoneError:
    # Every text argument is checked before it reaches a statement (Limits.check_text); this is the
    # net under a path that missed it, so the caller is refused (422 in the API) instead of failing.
    return InvalidInput(f"a text argument holds a character PostgreSQL cannot store ({message})")


_REFUSALS: dict[str, Callable[[str], StepstoneError]] = {
    "SSR01": VersionNotAdmitted,  # the registry's refusals (migration 0008) carry their own SQLSTATE
    "SSR02": lambda message: DefinitionDrift(message, definition_id="", version=0),
    "22021": _unstorable_text,  # character_not_in_repertoire: a NUL in a text parameter
    "22P05": _unstorable_text,  # untranslatable_character: \u0000 in a jsonb value
    # program_limit_exceeded: a value longer than an index entry holds (about 2,700 bytes), e.g. a start
    # whose input gives a flow limit's key of kilobytes; the caller's input, so refused, not a failure.
    "54000": lambda message: InvalidInput(f"a value is larger than PostgreSQL takes there ({message})"),
    # publish_message's refusal of a ttl the client refuses first: under a microsecond (migration 0078), negative,
    # NaN, infinite or over a thousand years (0079).
    "SSM01": lambda message: InvalidInput(message.removeprefix("stepstone: "), what="ttl"),
}


# asyncpg's words for a call on a pool its owner closed (or is closing).
_POOL_CLOSED = frozenset({"pool is closed", "pool is closing"})


@contextmanager
def translate_errors(url: str = "") -> Iterator[None]:
    """Map asyncpg and socket errors raised inside the block onto the stepstone hierarchy."""
    try:
        yield
    except StepstoneError:
        raise
    except asyncpg.InsufficientPrivilegeError as exc:
        raise InsufficientPrivilege(f"insufficient privilege: {_scrub(str(exc), url)}") from exc
    except (asyncpg.exceptions.UndefinedTableError, asyncpg.exceptions.InvalidSchemaNameError) as exc:
        # A store statement on a schema that was never migrated (or is missing a table).
        raise SchemaNotReady(f"the stepstone schema is not set up ({_scrub(str(exc), url)}): "
                             "run `stepstone db migrate` first", schema=None) from exc
    except (
        asyncpg.PostgresConnectionError,  # SQLSTATE class 08
        asyncpg.exceptions.OperatorInterventionError,  # class 57: shutdown, cannot connect now
        asyncpg.exceptions.InvalidAuthorizationSpecificationError,  # 28000: no such role, pg_hba
        asyncpg.exceptions.InvalidPasswordError,
        asyncpg.exceptions.InvalidCatalogNameError,  # database does not exist
        asyncpg.exceptions.ConnectionDoesNotExistError,
        asyncpg.exceptions.InternalClientError,
        asyncpg.exceptions.ClientConfigurationError,
        OSError,  # refused, unreachable, unknown host (socket.gaierror is an OSError)
        TimeoutError,
    ) as exc:
        raise _unavailable(url, str(exc) or type(exc).__name__) from exc
    except asyncpg.InterfaceError as exc:
        if str(exc) in _POOL_CLOSED:  # the caller's mistake, not an outage: retrying would never succeed
            raise ClientClosed("this store is closed: its Client (or its owner) called close()") from None
        if "closed" in str(exc) or "connection" in str(exc):
            raise _unavailable(url, str(exc)) from exc
        raise
    except asyncpg.PostgresError as exc:
        refusal = _REFUSALS.get(str(getattr(exc, "sqlstate", "")))
        if refusal is None:
            raise
        raise refusal(str(exc).splitlines()[0] if str(exc) else refusal.__name__) from None


async def connect(
    target: DatabaseTarget | Settings | str, *, timeout: float = DEFAULT_CONNECT_TIMEOUT, **kwargs: Any
) -> asyncpg.Connection:
    """Open one asyncpg connection; failures become DatabaseUnavailable naming host and port."""
    url = await _url_of(target)
    _check_url(url)
    with translate_errors(url):
        try:
            return await asyncpg.connect(url, timeout=timeout, **_session(kwargs))
        except ValueError as exc:  # asyncpg's DSN parser rejects malformed parts with ValueError
            raise _malformed(url, str(exc)) from exc
        except _REFUSED_PARAMETER as exc:
            raise _malformed(url, f"the server refused a parameter: {exc}") from exc
        except socket.gaierror as exc:
            raise _unavailable(url, f"unknown host ({exc.strerror})") from exc


async def create_pool(
    target: DatabaseTarget | Settings | str,
    *,
    min_size: int = 1,
    max_size: int = 10,
    timeout: float = DEFAULT_CONNECT_TIMEOUT,
    **kwargs: Any,
) -> asyncpg.Pool:
    """Open an asyncpg pool; failures become DatabaseUnavailable naming host and port."""
    install_one_line_driver_logs()
    url = await _url_of(target)
    _check_url(url)
    with translate_errors(url):
        try:
            pool = await asyncpg.create_pool(
                url, min_size=min_size, max_size=max_size, timeout=timeout,
                **_session({**kwargs, "init": _telling_recovery(kwargs.get("init"))}),
            )
        except ValueError as exc:
            raise _malformed(url, str(exc)) from exc
        except _REFUSED_PARAMETER as exc:
            raise _malformed(url, f"the server refused a parameter: {exc}") from exc
    assert pool is not None  # create_pool only returns None when not awaited
    return pool


def _telling_recovery(
    init: Callable[[asyncpg.Connection], Awaitable[None]] | None,
) -> Callable[[asyncpg.Connection], Awaitable[None]]:
    """The pool's `init` hook, run on each connection it makes: it ends a quiet run of floor failures."""
    async def connected(conn: asyncpg.Connection) -> None:
        _FLOOR.connected()
        if init is not None:
            await init(conn)
    return connected


def _session(kwargs: dict[str, Any]) -> dict[str, Any]:
    """asyncpg keyword arguments with stepstone's session settings under the caller's own."""
    return {**kwargs, "server_settings": {**SESSION_SETTINGS, **kwargs.get("server_settings", {})}}


async def _url_of(target: DatabaseTarget | Settings | str) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, DatabaseTarget):
        return target.url
    # Starting the embedded server blocks on pg_ctl; keep the event loop free meanwhile.
    resolved = await asyncio.to_thread(resolve_target, target)
    return resolved.url


class _OneLineRecords(logging.Filter):
    """Fold a record's traceback into one line: its message, the exception's type and first line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            text = str(exc).splitlines()[0] if str(exc) else ""
            record.msg = f"{record.getMessage()} ({type(exc).__name__}{': ' + text if text else ''})"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


_ONE_LINE = _OneLineRecords()
_FLOOR_FAILED = "Failed to restore the pool connection floor"


class _FloorOutage(logging.Filter):
    """asyncpg warns each time a pool fails to restore its connection floor, every second or two of an
    outage for each pool of the process. The first failure is said (once for every pool: one outage);
    the rest are quiet until a pool connects again, which is said at INFO with how many failed over how
    long, as the claim loop tells an outage (`stepstone.runtime.outage`)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 0
        self._since = 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        if _FLOOR_FAILED not in str(record.msg):
            return True
        self.failures += 1
        if self.failures > 1:
            return False
        self._since = time.monotonic()
        record.msg, record.args = f"{record.getMessage()} (said once: quiet until the pool connects again)", None
        return True

    def connected(self) -> None:
        """A pool made a connection: after failures, say so once."""
        if self.failures:
            log.info("database connections work again after %d failed attempt(s) to restore a pool over %.1f s",
                     self.failures, time.monotonic() - self._since)
            self.failures = 0


_FLOOR = _FloorOutage()


def install_one_line_driver_logs() -> None:
    """asyncpg's pool logs a full traceback each time it fails to reconnect (a PostgreSQL restart
    prints dozens of lines per attempt on a worker's or even a plain client's stderr); make each one
    line, like stepstone's own warnings, and say a run of them once (`_FloorOutage`). Idempotent."""
    pool_log = logging.getLogger("asyncpg.pool")
    for driver_filter in (_ONE_LINE, _FLOOR):  # in this order: the one said is folded first
        if driver_filter not in pool_log.filters:
            pool_log.addFilter(driver_filter)
