"""The one exception hierarchy of stepstone; driver errors are translated into it at the store boundary.

    StepstoneError                  root: anything stepstone raises on purpose
    ├── ConfigError                 bad configuration (flag, env var, pyproject.toml)
    └── DatabaseError               a problem talking to or with PostgreSQL
        ├── DatabaseUnavailable     unreachable, refused, malformed URL or transient (host, port)
        ├── InsufficientPrivilege   the role may not do what stepstone needs
        └── SchemaTooNew            the schema history has versions this stepstone does not know

A caller can tell configuration problems, transient database failures and refusals apart by class.
Messages are one line and never contain a password.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DatabaseError",
    "DatabaseUnavailable",
    "InsufficientPrivilege",
    "SchemaTooNew",
    "StepstoneError",
]


class StepstoneError(Exception):
    """Root of every error stepstone raises on purpose."""


class ConfigError(StepstoneError):
    """The configuration in effect is invalid (e.g. a schema name that is not a safe identifier)."""


class DatabaseError(StepstoneError):
    """Base for problems talking to or with PostgreSQL."""


class DatabaseUnavailable(DatabaseError):
    """The database cannot be reached (refused, unknown host, malformed URL, connection lost)."""

    def __init__(self, message: str, *, host: str | None = None, port: int | None = None) -> None:
        super().__init__(message)
        self.host = host
        self.port = port


class InsufficientPrivilege(DatabaseError):
    """The database role lacks a privilege stepstone needs (e.g. CREATE on the database)."""


class SchemaTooNew(DatabaseError):
    """The schema history records migrations newer than this stepstone ships; nothing was applied."""

    def __init__(self, message: str, *, unknown_versions: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.unknown_versions = unknown_versions
