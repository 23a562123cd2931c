"""``stepstone db``: migrate, status, the SQL a migration would run, and the embedded server."""

from __future__ import annotations

from typing import Any

import click

from stepstone.authoring.workflow import Registry
from stepstone.cli.app import app_option
from stepstone.cli.common import CliError, emit, output_option, run_async, with_settings
from stepstone.cli.lazy import LazyGroup
from stepstone.config import Settings
from stepstone.errors import StepstoneError
from stepstone.store import embedded
from stepstone.store import migrate as migrations
from stepstone.store.database import connect

__all__ = ["commands"]


@click.group("db", cls=LazyGroup, lazy={"grant": "operations:grant_command"})
def db_group() -> None:
    """Manage the database schema."""


@db_group.command("migrate")
@app_option(required=False)
@with_settings
@output_option
def migrate_command(settings: Settings, registry: Registry | None, output: str) -> None:  # noqa: ARG001 - as status
    """Apply pending migrations (safe to run concurrently and repeatedly); with --app, on the database
    the app names when none is configured."""

    async def go() -> tuple[list[migrations.Migration], list[int]]:
        conn = await connect(settings)
        try:
            applied = await migrations.migrate(conn, settings.schema)
            return applied, (await migrations.status(conn, settings.schema)).unknown
        finally:
            await conn.close()

    applied, newer = run_async(go())

    def text() -> str:
        said = ([f"schema {settings.schema}: nothing to apply: {migrations.newer_release(settings.schema, newer)}"]
                if newer else [] if applied else [f"schema {settings.schema}: up to date"])
        return "\n".join([*said, *(f"applied {m.version:04d}_{m.name}" for m in applied)])

    emit({"schema": settings.schema, "applied": [{"version": m.version, "name": m.name} for m in applied],
          "unknown": newer}, output, text)


@db_group.command("status")
@app_option(required=False)
@with_settings
@output_option
def status_command(settings: Settings, registry: Registry | None, output: str) -> None:  # noqa: ARG001 - as migrate
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
        # One line a version: an unknown or modified one is an applied one, said so on its line.
        notes = {**dict.fromkeys(state.unknown, ", unknown to this stepstone"),
                 **dict.fromkeys(state.modified, ", but the shipped file has changed")}
        lines = [f"{m.version:04d}_{m.name}  applied {m.applied_at:%Y-%m-%d %H:%M:%S%z}{notes.get(m.version, '')}"
                 for m in state.applied]
        lines += [f"{m.version:04d}_{m.name}  pending" for m in state.pending]
        return "\n".join(lines) if lines else "no migrations"

    emit(data, output, table)
    if state.unknown:
        raise CliError(f"schema {settings.schema} is newer than this stepstone (versions {state.unknown})")
    if state.pending:
        raise CliError(f"{len(state.pending)} pending migration(s): run `stepstone db migrate`")


@db_group.command("sql")
@click.option("--since", type=click.IntRange(0), default=0, show_default=True,
              help="Skip versions up to this one (at most the latest this stepstone ships).")
@with_settings
def sql_command(settings: Settings, since: int) -> None:
    """Print the SQL that `db migrate` would run on a database at version --since (offline)."""
    shipped = migrations.shipped_migrations()
    latest = max(m.version for m in shipped)
    if since > latest:  # a database this stepstone does not know: `db status` refuses it too
        raise click.BadParameter(f"{since} is past the latest version this stepstone ships ({latest})",
                                 param_hint="'--since'")
    applied = frozenset(m.version for m in shipped if m.version <= since)
    click.echo(migrations.pending_sql(settings.schema, applied), nl=False)


@db_group.group("server")
def server_group() -> None:
    """The embedded PostgreSQL server (the default database when none is configured).

    Its data lives in <project root>/.stepstone/pg: the project root is the directory of the nearest
    pyproject.toml above the current directory, else the current directory itself.
    """


@server_group.command("status")
@output_option
def server_status_command(output: str) -> None:
    """Show whether this project's embedded server runs, with its pid and socket."""
    try:
        state = embedded.server_state()
    except StepstoneError as exc:
        raise CliError(str(exc)) from exc
    data = {
        "data_dir": str(state.pgdata),
        "initialized": state.initialized,
        "running": state.running and state.foreign is None,
        "pid": state.pid if state.running else None,
        "socket_dir": str(state.socket_dir) if state.running and state.socket_dir else None,
        "copied_from": str(state.foreign) if state.foreign else None,
    }

    def table() -> str:
        if state.foreign is not None and state.running:
            return (f"{state.pgdata}: not usable, its postmaster.pid belongs to the server (pid {state.pid}) "
                    f"of {state.foreign}")
        if state.running:
            return f"{state.pgdata}: running (pid {state.pid}, socket in {state.socket_dir})"
        return f"{state.pgdata}: {'stopped' if state.initialized else 'not created yet'}"

    emit(data, output, table)


@server_group.command("start")
@output_option
def server_start_command(output: str) -> None:
    """Start this project's embedded server (creating it if needed); print its URL."""
    try:
        server = embedded.ensure_server()
    except StepstoneError as exc:
        raise CliError(str(exc)) from exc
    emit({"url": server.uri}, output, lambda: server.uri)


@server_group.command("stop")
@output_option
def server_stop_command(output: str) -> None:
    """Stop this project's embedded server (commands that need it start it again)."""
    data_dir = embedded.default_data_dir()
    try:
        stopped = embedded.stop_server(data_dir)
    except StepstoneError as exc:
        raise CliError(str(exc)) from exc
    emit({"data_dir": str(data_dir.resolve()), "stopped": stopped}, output,
         lambda: f"{data_dir.resolve()}: {'stopped' if stopped else 'was not running'}")


commands = [db_group]
