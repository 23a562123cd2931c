"""Schema migrations: ordered ``migrations/NNNN_name.sql`` files applied once each, under a lock.

Each pending file runs in its own transaction while the migrator holds a session-level advisory lock
derived from the schema name, so concurrent migrators apply every version exactly once. A history that records
versions this stepstone does not ship on top of every version it does is a newer release's schema: there is
nothing to apply, and this release runs on it (migrations only add, so the release before keeps running
through a rolling deploy, and again after a rollback; `MigrationStatus.usable`). A history with such versions
that lacks one this stepstone ships is refused with :class:`SchemaTooNew` before anything runs.

A file whose first line is ``-- stepstone: outside a transaction`` is the contract step of an
expand/contract change (``CREATE INDEX CONCURRENTLY`` and ``DROP INDEX CONCURRENTLY IF EXISTS``, which
PostgreSQL refuses inside a transaction block, and which neither block the workers nor break an older
release still running): its statements run one at a time, each on its own, and the version is recorded
after the last. The file must be safe to run again from the top (``IF EXISTS``; a ``CREATE INDEX
CONCURRENTLY`` preceded by a drop of the same name, which clears the invalid index an interrupted build
leaves): a migrator interrupted half-way runs it again.
Such a file holds plain statements, each ending with a semicolon at the end of a line.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache
from importlib import resources

import asyncpg

from stepstone.config import quote_ident, validate_schema_name
from stepstone.errors import InsufficientPrivilege, InternalError, SchemaTooNew
from stepstone.store.database import translate_errors
from stepstone.store.sqlfiles import render

__all__ = [
    "AppliedMigration",
    "Migration",
    "MigrationStatus",
    "advisory_lock_key",
    "migrate",
    "newer_release",
    "pending_sql",
    "shipped_migrations",
    "status",
    "too_new",
]

_FILE_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
OUTSIDE_A_TRANSACTION = "-- stepstone: outside a transaction"
LOCK_POLL_SECONDS = 0.05  # how often a migrator waiting for another one tries the lock again

_BOOTSTRAP = """\
CREATE SCHEMA IF NOT EXISTS {{schema}};
CREATE TABLE IF NOT EXISTS {{schema}}.schema_migrations (
    version int PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    checksum text NOT NULL
);
"""


@dataclass(frozen=True)
class Migration:
    """One shipped migration file."""

    version: int
    name: str
    sql: str  # raw text, with the {{schema}} placeholder
    checksum: str  # sha256 of the raw text

    def rendered(self, schema: str) -> str:
        """The SQL to run for ``schema``."""
        return render(self.sql, schema)

    @property
    def transactional(self) -> bool:
        """False for a contract step that must run outside a transaction block (see the module)."""
        return not self.sql.startswith(OUTSIDE_A_TRANSACTION)

    def statements(self, schema: str) -> list[str]:
        """The statements of a migration that runs outside a transaction, one by one."""
        body = re.sub(r"^--[^\n]*$", "", self.rendered(schema), flags=re.MULTILINE)
        return [part.strip() for part in re.split(r";\s*$", body, flags=re.MULTILINE) if part.strip()]


@dataclass(frozen=True)
class AppliedMigration:
    """One row of ``schema_migrations``."""

    version: int
    name: str
    applied_at: datetime
    checksum: str


@dataclass(frozen=True)
class MigrationStatus:
    """Applied, pending and unknown (newer than shipped) versions, plus checksum mismatches."""

    applied: list[AppliedMigration] = field(default_factory=list)
    pending: list[Migration] = field(default_factory=list)
    unknown: list[int] = field(default_factory=list)
    modified: list[int] = field(default_factory=list)  # applied, but the shipped file has changed since

    @property
    def current_version(self) -> int | None:
        """Highest applied version, or None on a fresh database."""
        return max((m.version for m in self.applied), default=None)

    @property
    def usable(self) -> bool:
        """This release can run on the schema: every migration it ships is applied. Versions a newer
        release added on top (`unknown`) are additive, so they do not count against it."""
        return self.current_version is not None and not self.pending

    @property
    def refused(self) -> bool:
        """Versions this release does not know beside ones it ships that are missing: no release's schema."""
        return bool(self.unknown and self.pending)


@cache
def shipped_migrations() -> tuple[Migration, ...]:
    """The migration files shipped with this stepstone, in version order."""
    found: list[Migration] = []
    for entry in resources.files("stepstone.store").joinpath("migrations").iterdir():
        match = _FILE_NAME.match(entry.name)
        if match is None:
            if entry.name.endswith(".sql"):
                raise InternalError(f"migration file {entry.name!r} does not match NNNN_name.sql")
            continue
        text = entry.read_text(encoding="utf-8")
        found.append(
            Migration(
                version=int(match.group(1)),
                name=match.group(2),
                sql=text,
                checksum=hashlib.sha256(text.encode()).hexdigest(),
            )
        )
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise InternalError(f"duplicate migration versions in {versions}")
    return tuple(found)


def advisory_lock_key(schema: str) -> int:
    """A stable signed 64-bit advisory lock key for migrating ``schema``."""
    digest = hashlib.sha256(f"stepstone.migrate:{validate_schema_name(schema)}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def pending_sql(schema: str, applied: frozenset[int] = frozenset()) -> str:
    """The SQL that migrating ``schema`` would run, given the versions already ``applied``."""
    chunks = [f"-- stepstone bootstrap\n{render(_BOOTSTRAP, schema)}"]
    for migration in shipped_migrations():
        if migration.version in applied:
            continue
        outside = "" if migration.transactional else "-- (run these statements outside a transaction block)\n"
        chunks.append(
            f"-- {migration.version:04d}_{migration.name}\n{outside}{migration.rendered(schema).rstrip()}\n"
            f"INSERT INTO {quote_ident(schema)}.schema_migrations (version, name, checksum)"
            f" VALUES ({migration.version}, '{migration.name}', '{migration.checksum}');\n"
        )
    return "\n".join(chunks)


async def _read_history(conn: asyncpg.Connection, schema: str) -> list[AppliedMigration] | None:
    """Rows of schema_migrations, or None when the table does not exist."""
    table = f"{quote_ident(schema)}.schema_migrations"
    exists = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", table)
    if not exists:
        return None
    rows = await conn.fetch(
        render("SELECT version, name, applied_at, checksum FROM {{schema}}.schema_migrations "
               "ORDER BY version", schema)
    )
    return [AppliedMigration(r["version"], r["name"], r["applied_at"], r["checksum"]) for r in rows]


# The schema's owner can drop and recreate any object in it (commit_segment included), so migrating
# into a schema another role owns would hand that role the engine's functions.
_SCHEMA_OWNER = (
    "SELECT nspowner::regrole::text AS owner, current_user::text AS me, "
    "nspowner = (SELECT oid FROM pg_roles WHERE rolname = current_user) AS mine "
    "FROM pg_namespace WHERE nspname = $1"
)


async def _check_owner(conn: asyncpg.Connection, schema: str) -> None:
    """Refuse an existing schema that the migrating role does not own."""
    row = await conn.fetchrow(_SCHEMA_OWNER, schema)
    if row is not None and not row["mine"]:
        raise InsufficientPrivilege(
            f"schema {schema!r} is owned by role {row['owner']}, not by {row['me']} (the migrating role): "
            f"refusing to migrate, since its owner could replace stepstone's functions; migrate as its "
            f"owner, or drop it and let {row['me']} create it"
        )


def _status_from(history: list[AppliedMigration]) -> MigrationStatus:
    shipped = {m.version: m for m in shipped_migrations()}
    applied_versions = {m.version for m in history}
    return MigrationStatus(
        applied=history,
        pending=[m for v, m in sorted(shipped.items()) if v not in applied_versions],
        unknown=sorted(v for v in applied_versions if v not in shipped),
        modified=sorted(m.version for m in history if m.version in shipped
                        and shipped[m.version].checksum != m.checksum),
    )


async def status(conn: asyncpg.Connection, schema: str) -> MigrationStatus:
    """What is applied, pending and unknown in ``schema``; creates nothing."""
    validate_schema_name(schema)
    with translate_errors():
        history = await _read_history(conn, schema)
    return _status_from(history or [])


def newer_release(schema: str, unknown: list[int]) -> str:
    """What a release says when it runs on a schema a newer release has migrated."""
    latest = max((m.version for m in shipped_migrations()), default=0)
    return (f"schema {schema!r} has migration(s) {', '.join(map(str, unknown))} of a newer stepstone (this one "
            f"knows up to {latest}); running on it, since migrations only add: upgrade stepstone when you can")


def too_new(schema: str, unknown: list[int]) -> SchemaTooNew:
    latest = max((m.version for m in shipped_migrations()), default=0)
    return SchemaTooNew(
        f"schema {schema!r} has migration(s) {', '.join(map(str, unknown))} but this stepstone only "
        f"knows up to {latest}: upgrade stepstone",
        unknown_versions=tuple(unknown),
    )


async def _record(conn: asyncpg.Connection, schema: str, migration: Migration) -> None:
    await conn.execute(
        render("INSERT INTO {{schema}}.schema_migrations (version, name, checksum) VALUES ($1, $2, $3)", schema),
        migration.version,
        migration.name,
        migration.checksum,
    )


async def _lock(conn: asyncpg.Connection, key: int) -> None:
    """Take the migrators' lock by polling, not by waiting inside pg_advisory_lock: a session blocked in
    that call holds a snapshot for as long as it waits, and CREATE INDEX CONCURRENTLY in the holder's
    contract step waits for every older snapshot to go, so two migrators would deadlock."""
    while True:
        if await conn.fetchval("SELECT pg_try_advisory_lock($1)", key):
            return
        await asyncio.sleep(LOCK_POLL_SECONDS)


async def migrate(conn: asyncpg.Connection, schema: str) -> list[Migration]:
    """Apply pending migrations to ``schema``, each in its own transaction under a lock; return them.

    Safe to call concurrently from several processes and idempotent.
    """
    validate_schema_name(schema)
    key = advisory_lock_key(schema)
    applied_now: list[Migration] = []
    with translate_errors():
        # Pre-check without creating anything, so a too-new history or a missing privilege on an
        # up-to-date schema does not try to create the schema.
        history = await _read_history(conn, schema)
        if history is not None:
            current = _status_from(history)
            if current.refused:
                raise too_new(schema, current.unknown)
            if not current.pending:
                return applied_now
        # A session lock, so that every transaction below starts after the lock is held and so sees
        # (with fresh catalog caches) whatever a concurrent migrator committed before releasing it.
        await _lock(conn, key)
        try:
            while True:
                async with conn.transaction():
                    await _check_owner(conn, schema)
                    history = await _read_history(conn, schema)
                    if history is None:
                        await conn.execute(render(_BOOTSTRAP, schema))
                        history = []
                    current = _status_from(history)
                    if current.refused:
                        raise too_new(schema, current.unknown)
                    if not current.pending:
                        return applied_now
                    migration = current.pending[0]
                    if migration.transactional:
                        await conn.execute(migration.rendered(schema))
                        await _record(conn, schema, migration)
                if not migration.transactional:
                    for statement in migration.statements(schema):
                        await conn.execute(statement)
                    async with conn.transaction():
                        await _record(conn, schema, migration)
                applied_now.append(migration)
        finally:
            if not conn.is_closed():
                with suppress(asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
                    await conn.execute("SELECT pg_advisory_unlock($1)", key)
