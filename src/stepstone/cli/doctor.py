"""``stepstone doctor``: the configuration in effect and whether the database is ready for it.

Problems (exit 1): the database is unreachable or its schema lacks a shipped migration, or the
configured broker has no publisher installed.
Warnings (exit 0): a schema a newer release has migrated further (this one runs on it), a database
clock a test moved and left moved (`stepstone.testing`'s `advance`),
work the engine holds back, such as commands deferred because no worker that claimed them has their
pin (a plan deployed nowhere, or retired too early), or a configured broker that does not answer
(events wait in the outbox). The broker's URL is shown with its password masked.
"""

from __future__ import annotations

from datetime import UTC
from typing import Any

import click

from stepstone.cli.common import CliError, emit, output_option, render_table, run_async, with_settings
from stepstone.config import Settings, quote_ident
from stepstone.errors import StepstoneError
from stepstone.outbox.probe import probe_broker
from stepstone.outbox.publisher import open_publisher
from stepstone.store import health
from stepstone.store import migrate as migrations
from stepstone.store.database import DatabaseTarget, connect, redact_url, resolve_target
from stepstone.store.health_registry import stranded_pins

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
        "warnings": [],
    }
    problems: list[str] = report["problems"]
    if settings.broker_url:
        report["config"]["broker_url"] = {"value": redact_url(settings.broker_url),
                                          "source": settings.sources.get("broker_url", "default")}
        report["broker"] = await _check_broker(settings.broker_url, report)
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
        database["server_version"] = await health.server_version(conn, settings.schema)
        state = await migrations.status(conn, settings.schema)
        if state.usable:
            database["clock_offset_seconds"] = offset = await health.clock_offset(conn, settings.schema)
            if offset:
                report["warnings"].append(_clock_warning(offset, settings.schema))
            report["deferred_pins"] = [_deferred(d) for d in await health.deferred_pins(conn, settings.schema)]
            report["warnings"] += [_deferred_warning(d) for d in report["deferred_pins"]]
            role, can_alter = await health.role_can_alter_schema(conn, settings.schema)
            database["role"] = {"name": role, "can_alter_schema": can_alter}
            if can_alter:
                report["warnings"].append(
                    f"role {role} can alter schema {settings.schema} (owner, CREATE or superuser): run workers "
                    f"and clients as a runtime role without DDL (`stepstone db grant ROLE`, docs/operations.md)")
            report["stranded"] = await stranded_pins(conn, settings.schema)
            report["warnings"] += [_stranded_warning(s) for s in report["stranded"]]
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
    if state.refused:
        problems.append(str(migrations.too_new(settings.schema, state.unknown)))
    elif state.unknown:
        report["warnings"].append(migrations.newer_release(settings.schema, state.unknown))
    if state.pending:
        problems.append(f"{len(state.pending)} pending migration(s): run `stepstone db migrate`")
    return report


async def _check_broker(url: str, report: dict[str, Any]) -> dict[str, Any]:
    """The outbox's broker: its publisher is installed (a problem otherwise: the relay cannot start)
    and it answers (a warning otherwise: events wait in the outbox until it does)."""
    try:
        publisher = open_publisher(url)
    except StepstoneError as exc:
        report["problems"].append(str(exc))
        return {"url": redact_url(url), "publisher": False, "answers": None, "detail": str(exc)}
    await publisher.close()
    probe = await probe_broker(url)
    if probe.answers is False:
        report["warnings"].append(f"the broker {probe.url} does not answer ({probe.detail}); events wait in the "
                                  "outbox until it does")
    return {"url": probe.url, "publisher": True, "answers": probe.answers, "detail": probe.detail}


def _clock_warning(offset: float, schema: str) -> str:
    return (f"the database clock (db_now()) is {offset:+g} s ({offset / 86_400:+.2f} days) off the server's: "
            "every timer, lease and schedule here runs on that time; a test moved it and left it "
            f"(`UPDATE {quote_ident(schema)}.clock SET offset_by = '0'` puts it back)")


def _deferred(found: health.DeferredPin) -> dict[str, Any]:
    pin = found.pin
    return {
        "scope": pin.scope, "definition_id": pin.definition_id, "version": pin.version, "plan_hash": pin.plan_hash,
        "commands": found.commands, "oldest": found.oldest.astimezone(UTC).isoformat(timespec="seconds"),
        "deferrals": found.deferrals,
    }


def _deferred_warning(d: dict[str, Any]) -> str:
    return (f"{d['commands']} command(s) of {d['definition_id']} v{d['version']} (plan {d['plan_hash'][:12]}, "
            f"scope {d['scope']}) deferred: no worker that claimed them has this pin; oldest created "
            f"{d['oldest']}, deferred up to {d['deferrals']} time(s)")


def _stranded_warning(s: dict[str, Any]) -> str:
    return (f"{s['instances']} instance(s) of {s['definition_id']} v{s['version']} (plan {s['plan_hash'][:12]}) "
            f"are stranded: no live worker served this version in the last {s['within_minutes']:g} minutes "
            "(`stepstone definitions stranded`)")


def _table(report: dict[str, Any]) -> str:
    config = report["config"]
    rows: list[list[Any]] = [
        ["database_url", config["database_url"]["value"] or "(none)", config["database_url"]["source"]],
        ["schema", config["schema"]["value"], config["schema"]["source"]],
    ]
    if "broker_url" in config:
        rows.append(["broker_url", config["broker_url"]["value"], config["broker_url"]["source"]])
    out = ["configuration", render_table(rows, ["setting", "value", "source"]), ""]
    broker = report.get("broker")
    if broker is not None:
        answers = {True: "yes", False: "no", None: "-"}[broker["answers"]]
        out += ["broker", render_table([["url", broker["url"]], ["answers", answers], ["detail", broker["detail"]]]),
                ""]
    out.append("database")
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
    out += [f"warning: {w}" for w in report["warnings"]]
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
