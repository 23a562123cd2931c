"""Connecting to PostgreSQL and translating driver errors into the stepstone hierarchy.

Every asyncpg call that may fail for a reason a caller should tell apart (unreachable, privilege) runs
inside :func:`translate_errors` or goes through :func:`connect` / :func:`create_pool`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import asyncpg

from stepstone.config import Settings
from stepstone.errors import DatabaseError, DatabaseUnavailable, InsufficientPrivilege
from stepstone.store import embedded

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
_PASSWORD_IN_URL = re.compile(r"(://[^:/@?#]*:)([^@/?#]+)@")


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


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***``."""
    return _PASSWORD_IN_URL.sub(r"\1***@", url)


def endpoint(url: str) -> tuple[str, int | None]:
    """(host, port) named by a URL for messages; a socket directory counts as the host."""
    try:
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        host = parts.hostname or (query.get("host") or ["localhost"])[0]
        port = parts.port or int((query.get("port") or ["5432"])[0])
    except ValueError:
        return "?", None
    return host, port


def _scrub(text: str, url: str) -> str:
    """Remove the URL's password (and the URL itself) from a driver message; keep the first line."""
    first = text.splitlines()[0] if text else ""
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    first = first.replace(url, redact_url(url))
    if password:
        first = first.replace(password, "***")
    return _PASSWORD_IN_URL.sub(r"\1***@", first)


def _unavailable(url: str, reason: str) -> DatabaseUnavailable:
    host, port = endpoint(url)
    where = f"{host}:{port}" if port is not None else host
    message = f"cannot reach PostgreSQL at {where}: {_scrub(reason, url)}"
    return DatabaseUnavailable(message, host=host, port=port)


def _check_url(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres"):
        raise _unavailable(url, "malformed database URL (expected postgresql://user@host:port/dbname)")
    try:
        _ = parts.port
    except ValueError as exc:
        raise _unavailable(url, f"malformed database URL ({exc})") from exc


@contextmanager
def translate_errors(url: str = "") -> Iterator[None]:
    """Map asyncpg and socket errors raised inside the block onto the stepstone hierarchy."""
    try:
        yield
    except DatabaseError:
        raise
    except asyncpg.InsufficientPrivilegeError as exc:
        raise InsufficientPrivilege(f"insufficient privilege: {_scrub(str(exc), url)}") from exc
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
        if "closed" in str(exc) or "connection" in str(exc):
            raise _unavailable(url, str(exc)) from exc
        raise


async def connect(
    target: DatabaseTarget | Settings | str, *, timeout: float = DEFAULT_CONNECT_TIMEOUT, **kwargs: Any
) -> asyncpg.Connection:
    """Open one asyncpg connection; failures become DatabaseUnavailable naming host and port."""
    url = await _url_of(target)
    _check_url(url)
    with translate_errors(url):
        try:
            return await asyncpg.connect(url, timeout=timeout, **kwargs)
        except ValueError as exc:  # asyncpg's DSN parser rejects malformed parts with ValueError
            raise _unavailable(url, f"malformed database URL ({exc})") from exc
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
                url, min_size=min_size, max_size=max_size, timeout=timeout, **kwargs
            )
        except ValueError as exc:
            raise _unavailable(url, f"malformed database URL ({exc})") from exc
    assert pool is not None  # create_pool only returns None when not awaited
    return pool


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


def install_one_line_driver_logs() -> None:
    """asyncpg's pool logs a full traceback each time it fails to reconnect (a PostgreSQL restart
    prints dozens of lines per attempt on a worker's or even a plain client's stderr); make each one
    line, like stepstone's own warnings. Idempotent."""
    pool_log = logging.getLogger("asyncpg.pool")
    if _ONE_LINE not in pool_log.filters:
        pool_log.addFilter(_ONE_LINE)
