"""``stepstone db``: migrate, status and the SQL a migration would run."""

from __future__ import annotations

from typing import Any

import click

from stepstone.cli.common import CliError, emit, output_option, run_async, with_settings
from stepstone.config import Settings
from stepstone.store import migrate as migrations
from stepstone.store.database import connect

__all__ = ["commands"]


@click.group("db")
def db_group() -> None:
    """Manage the database schema."""


@db_group.command("migrate")
@with_settings
def migrate_command(settings: Settings) -> None:
    """Apply pending migrations (safe to run concurrently and repeatedly)."""

    async def go() -> list[migrations.Migration]:
        conn = await connect(settings)
        try:
            return await migrations.migrate(conn, settings.schema)
        finally:
            await conn.close()

    applied = run_async(go())
    if not applied:
        click.echo(f"schema {settings.schema}: up to date")
    for migration in applied:
        click.echo(f"applied {migration.version:04d}_{migration.name}")


@db_group.command("status")
@with_settings
@output_option
def status_command(settings: Settings, output: str) -> None:
    """Show applied and pending migrations; exit 1 when migrations are pending or unknown."""

    async def go() -> migrations.MigrationStatus:
        conn = await connect(settings)
        try:
            return await migrations.status(conn, settings.schema)
        finally:
            await conn.close()

    state = run_async(go())
    data: dict[str, Any] = {
        "schema": settings.schema,
        "applied": [
            {"version": m.version, "name": m.name, "applied_at": m.applied_at.isoformat()}
            for m in state.applied
        ],
        "pending": [{"version": m.version, "name": m.name} for m in state.pending],
        "unknown": state.unknown,
        "modified": state.modified,
    }

    def table() -> str:
        lines = [f"{m.version:04d}_{m.name}  applied {m.applied_at:%Y-%m-%d %H:%M:%S%z}"
                 for m in state.applied]
        lines += [f"{m.version:04d}_{m.name}  pending" for m in state.pending]
        lines += [f"{v:04d}  unknown to this stepstone" for v in state.unknown]
        lines += [f"{v:04d}  applied, but the shipped file has changed" for v in state.modified]
        return "\n".join(lines) if lines else "no migrations"

    emit(data, output, table)
    if state.unknown:
        raise CliError(f"schema {settings.schema} is newer than this stepstone (versions {state.unknown})")
    if state.pending:
        raise CliError(f"{len(state.pending)} pending migration(s): run `stepstone db migrate`")


@db_group.command("sql")
@click.option("--since", type=int, default=0, show_default=True, help="Skip versions up to this one.")
@with_settings
def sql_command(settings: Settings, since: int) -> None:
    """Print the SQL that `db migrate` would run on a database at version --since (offline)."""
    applied = frozenset(m.version for m in migrations.shipped_migrations() if m.version <= since)
    click.echo(migrations.pending_sql(settings.schema, applied), nl=False)


commands = [db_group]
