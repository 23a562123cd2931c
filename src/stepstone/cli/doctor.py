"""``stepstone doctor``: the configuration in effect and whether the database is ready for it."""

from __future__ import annotations

from typing import Any

import click

from stepstone.cli.common import CliError, emit, output_option, render_table, run_async, with_settings
from stepstone.config import Settings
from stepstone.errors import StepstoneError
from stepstone.store import migrate as migrations
from stepstone.store.database import DatabaseTarget, connect, redact_url, resolve_target

__all__ = ["commands"]


async def _diagnose(settings: Settings) -> dict[str, Any]:
    report: dict[str, Any] = {
        "config": {
            "database_url": {
                "value": redact_url(settings.database_url) if settings.database_url else None,
                "source": settings.sources.get("database_url", "default"),
            },
            "schema": {"value": settings.schema, "source": settings.sources.get("schema", "default")},
        },
        "problems": [],
    }
    problems: list[str] = report["problems"]
    try:
        target: DatabaseTarget = resolve_target(settings)
    except StepstoneError as exc:
        report["database"] = {"mode": "embedded", "reachable": False}
        problems.append(str(exc))
        return report
    database: dict[str, Any] = {
        "mode": "embedded" if target.embedded else "configured",
        "data_dir": str(target.pgdata) if target.pgdata else None,
        "url": redact_url(target.url),
        "reachable": False,
    }
    report["database"] = database
    try:
        conn = await connect(target)
    except StepstoneError as exc:
        problems.append(str(exc))
        return report
    try:
        database["reachable"] = True
        database["server_version"] = await conn.fetchval("SHOW server_version")
        state = await migrations.status(conn, settings.schema)
    except StepstoneError as exc:
        problems.append(str(exc))
        return report
    finally:
        await conn.close()
    latest = max((m.version for m in migrations.shipped_migrations()), default=None)
    report["schema"] = {
        "version": state.current_version,
        "latest_shipped": latest,
        "pending": [f"{m.version:04d}_{m.name}" for m in state.pending],
        "unknown": state.unknown,
    }
    if state.unknown:
        problems.append(f"schema {settings.schema} has versions {state.unknown} unknown to this stepstone")
    if state.pending:
        problems.append(f"{len(state.pending)} pending migration(s): run `stepstone db migrate`")
    return report


def _table(report: dict[str, Any]) -> str:
    config = report["config"]
    rows: list[list[Any]] = [
        ["database_url", config["database_url"]["value"] or "(none)", config["database_url"]["source"]],
        ["schema", config["schema"]["value"], config["schema"]["source"]],
    ]
    out = ["configuration", render_table(rows, ["setting", "value", "source"]), "", "database"]
    database = report.get("database", {})
    db_rows: list[list[Any]] = [["mode", database.get("mode", "?")]]
    if database.get("data_dir"):
        db_rows.append(["data dir", database["data_dir"]])
    if database.get("url"):
        db_rows.append(["url", database["url"]])
    db_rows.append(["reachable", "yes" if database.get("reachable") else "no"])
    if "server_version" in database:
        db_rows.append(["server version", database["server_version"]])
    schema = report.get("schema")
    if schema is not None:
        version = schema["version"] if schema["version"] is not None else "none (not migrated)"
        db_rows.append(["schema version", f"{version} (latest shipped {schema['latest_shipped']})"])
        db_rows.append(["pending", ", ".join(schema["pending"]) or "none"])
        if schema["unknown"]:
            db_rows.append(["unknown versions", ", ".join(map(str, schema["unknown"]))])
    out.append(render_table(db_rows))
    out += ["", "status: " + ("ok" if not report["problems"] else "PROBLEMS")]
    out += [f"  - {p}" for p in report["problems"]]
    return "\n".join(out)


@click.command("doctor")
@with_settings
@output_option
def doctor_command(settings: Settings, output: str) -> None:
    """Show configuration and its sources, and check the database; exit 1 when something is wrong."""
    report = run_async(_diagnose(settings))
    emit(report, output, lambda: _table(report))
    if report["problems"]:
        raise CliError(report["problems"][0])


commands = [doctor_command]
