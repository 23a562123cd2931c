"""``stepstone definitions``: the registry of workflow versions.

    list        versions with kind, status and which scopes they are current in
    show        one version (and a document's text, its digest checked)
    validate    check a YAML/JSON document against the schema (and a catalog's handler names)
    publish     validate, record and publish a document (CANDIDATE -> PUBLISHING -> AVAILABLE)
    activate    make a version the scope's current one
    deprecate / retire / reinstate   the lifecycle (docs/versions.md)
    stranded    instances whose pinned version no live worker serves
    migrate     move instances to another version (docs/versions.md)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from stepstone.authoring.documents import DEFAULT_MAX_BYTES, Catalog, load_document
from stepstone.cli.app import app_option, import_attribute
from stepstone.cli.common import (
    TEXT,
    VERSION,
    CliError,
    Duration,
    Finite,
    emit,
    output_option,
    render_table,
    run_async,
    with_settings,
)
from stepstone.cli.connection import open_store
from stepstone.config import Settings
from stepstone.core.pin import DEFAULT_SCOPE
from stepstone.core.timestamps import MAX_SECONDS
from stepstone.errors import DocumentInvalid, StepstoneError
from stepstone.ops import definitions as ops
from stepstone.ops.migration import DEFAULT_PATIENCE

__all__ = ["commands", "load_catalog"]

_scope_option = click.option("--scope", default=DEFAULT_SCOPE, show_default=True, type=TEXT,
                             help="The scope (tenant key) of the definition.")
_max_bytes_option = click.option("--max-bytes", type=click.IntRange(1), default=DEFAULT_MAX_BYTES,
                                 show_default=True, help="Largest document accepted, in bytes of UTF-8.")


def load_catalog(spec: str) -> Catalog:
    value = import_attribute(spec, "--catalog", "myapp.handlers:catalog")
    if not isinstance(value, Catalog):
        raise CliError(f"{spec} is a {type(value).__name__}, not a stepstone Catalog")
    return value


def _read(path: str) -> tuple[str, str]:
    file = Path(path)
    try:
        text = file.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}") from None
    return text, "json" if file.suffix.lower() == ".json" else "yaml"


def _refused(exc: StepstoneError, output: str = "table") -> CliError:
    """The error to exit with: a document's every problem a line each, as a validator lists them (with
    `-o json`, also ``{"valid": false, "problems": [...]}`` on stdout)."""
    if isinstance(exc, DocumentInvalid):
        if output == "json":
            emit({"valid": False, "problems": list(exc.problems)}, output, lambda: "")
        if len(exc.problems) > 1:
            return CliError(f"{len(exc.problems)} problems in the document:\n" + "\n".join(
                f"  {_place(p)}{p['message']}" for p in exc.problems))
    return CliError(str(exc).splitlines()[0])


def _place(problem: dict[str, Any]) -> str:
    at = f"line {problem['line']}, column {problem['column']} " if problem["line"] is not None else ""
    return f"{at}({problem['path']}): " if problem["path"] else at


@click.group("definitions")
def definitions_group() -> None:
    """Workflow versions: list, show, validate and publish documents, activate, deprecate, retire, migrate."""


@definitions_group.command("list")
@click.option("--scope", default=None, type=TEXT, help="Only this scope.")
@click.option("--workflow", "definition_id", default=None, type=TEXT, help="Only this definition id.")
@click.option("--status", default=None, type=click.Choice(["CANDIDATE", "PUBLISHING", "AVAILABLE", "DEPRECATED",
                                                           "RETIRED"]))
@output_option
@with_settings
def list_command(settings: Settings, scope: str | None, definition_id: str | None, status: str | None,
                 output: str) -> None:
    """List recorded versions (never the document text)."""

    async def go() -> list[dict[str, Any]]:
        async with open_store(settings) as store:
            records = await store.definitions.records(scope=scope, definition_id=definition_id, status=status)
            return [{"scope": r.scope, "workflow": r.definition_id, "version": r.version, "kind": r.kind,
                     "status": r.status, "active": r.active, "plan_hash": r.plan_hash} for r in records]

    rows = run_async(go())
    emit(rows, output, lambda: render_table(
        [[r["workflow"], r["version"], r["scope"], r["kind"], r["status"], "yes" if r["active"] else "",
          r["plan_hash"][:12]] for r in rows],
        ["workflow", "version", "scope", "kind", "status", "current", "plan"]) if rows else "no definitions recorded")


@definitions_group.command("show")
@click.argument("definition_id", type=TEXT)
@click.argument("version", type=VERSION)
@_scope_option
@output_option
@with_settings
def show_command(settings: Settings, definition_id: str, version: int, scope: str, output: str) -> None:
    """Show one version; a document's text is printed only when it still matches its SHA-256 digest."""

    async def go() -> dict[str, Any]:
        async with open_store(settings) as store:
            row = await store.definitions.find(scope, definition_id, version)
            shown = {k: row[k] for k in ("scope", "definition_id", "version", "kind", "status", "plan_hash",
                                         "state_model", "signal_names", "document_digest")}
            if row["kind"] == "DOCUMENT":
                shown["document"], _ = await store.definitions.document(scope, definition_id, version)
            return shown

    shown = run_async(go())

    def table() -> str:
        rows = [[k, json.dumps(v) if isinstance(v, list) else v] for k, v in shown.items() if k != "document"]
        text = render_table(rows)
        return text + ("\n\n" + shown["document"].rstrip() if "document" in shown else "")

    emit(shown, output, table)


@definitions_group.command("validate")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--catalog", default=None, metavar="MODULE:ATTR",
              help="The Catalog whose handler and model names the document may use (without it: structure only).")
@_max_bytes_option
@output_option
def validate_command(file: str, catalog: str | None, max_bytes: int, output: str) -> None:
    """Check a YAML or JSON workflow document; prints every problem of the first stage that finds any, each
    with its line, column and path."""
    text, fmt = _read(file)
    found = load_catalog(catalog) if catalog else None
    try:
        wf = load_document(text, found, fmt=fmt, max_bytes=max_bytes)
    except StepstoneError as exc:
        raise _refused(exc, output) from None
    count = len(wf.plan.steps)
    steps = f"{count} step" if count == 1 else f"{count} steps"
    checked = ("schema, handlers and graph" if found is not None
               else "schema and graph (no --catalog: handlers unchecked)")
    emit({"valid": True, "workflow": wf.id, "version": wf.version, "scope": wf.scope, "steps": count,
          "plan_hash": wf.plan.plan_hash, "handlers_checked": found is not None}, output,
         lambda: f"valid: {wf.id} v{wf.version} (scope {wf.scope}), {steps}, "
                 f"plan {wf.plan.plan_hash[:12]}; checked {checked}")


@definitions_group.command("publish")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--catalog", required=True, metavar="MODULE:ATTR",
              help="The Catalog whose handlers the document binds (every node that runs it needs the same).")
@_max_bytes_option
@output_option
@with_settings
def publish_command(settings: Settings, file: str, catalog: str, max_bytes: int, output: str) -> None:
    """Validate, record and publish a document; nothing is written when it is invalid."""
    text, fmt = _read(file)
    found = load_catalog(catalog)

    async def go() -> ops.Published:
        async with open_store(settings) as store:
            try:
                return await ops.publish_document(store.definitions, text, found, fmt=fmt, max_bytes=max_bytes)
            except DocumentInvalid as exc:  # nothing was written
                raise _refused(exc, output) from None

    done = run_async(go())
    pin = done.pin
    note = {"inserted": "", "attached": " (registered before without its text: the text is stored now)"}.get(
        done.recorded, " (already recorded with this text)")
    emit({"workflow": pin.definition_id, "version": pin.version, "scope": pin.scope, "plan_hash": pin.plan_hash,
          "status": done.status, "recorded": done.recorded}, output,
         lambda: f"published {pin.definition_id} v{pin.version} (scope {pin.scope}, plan {pin.plan_hash[:12]}): "
                 f"{done.status}{note}")


@definitions_group.command("activate")
@click.argument("definition_id", type=TEXT)
@click.argument("version", type=VERSION)
@_scope_option
@click.option("--from-default", is_flag=True, help="Follow this version of the default scope (for a tenant scope).")
@output_option
@with_settings
def activate_command(settings: Settings, definition_id: str, version: int, scope: str, from_default: bool,
                     output: str) -> None:
    """Make VERSION the current version of the scope: starts by id select it from now on. A schedule whose
    ticks now start VERSION and whose input VERSION's input schema refuses is named in a warning."""
    target = DEFAULT_SCOPE if from_default else scope

    async def go() -> ops.Activated:
        async with open_store(settings) as store:
            return await ops.activate(store, scope, definition_id, version, target_scope=target, actor="cli",
                                      log_refused=False)  # printed below, a `warning:` line each

    done = run_async(go())
    refused = done.schedules_refused
    emit(done.as_dict(), output,
         lambda: f"scope {scope}: {definition_id} v{version}" + (" (of scope default)" if target != scope else "")
         + " is current")
    for r in refused:
        click.echo(f"warning: schedule {r.name} (scope {r.scope}) starts {definition_id} v{version} now, whose input "
                   f"schema refuses its input ({r.problem}): every tick will be skipped until its input or the "
                   f"activation changes (`stepstone schedules create {r.name} {definition_id} --input ...`)", err=True)


def _lifecycle(name: str, to: str, help_text: str) -> None:
    @definitions_group.command(name, help=help_text)
    @click.argument("definition_id", type=TEXT)
    @click.argument("version", type=VERSION)
    @_scope_option
    @app_option(required=False)
    @output_option
    @with_settings
    def command(settings: Settings, definition_id: str, version: int, scope: str, registry: Any, output: str) -> None:
        plan_hash = None
        if to == "AVAILABLE" and registry is not None:  # the code at hand must be the recorded plan
            wf = registry.find(definition_id, version)
            if wf is None:
                raise CliError(f"--app has no {definition_id} v{version}, so its plan hash cannot be checked against "
                               "the recorded one; nothing was changed (leave out --app to reinstate unchecked)")
            plan_hash = wf.plan.plan_hash

        async def go() -> str:
            async with open_store(settings) as store:
                return await store.definitions.transition(scope, definition_id, version, to, plan_hash=plan_hash)

        before = run_async(go())  # the status it already had is no change, and no error (as the store has it)
        emit({"workflow": definition_id, "version": version, "scope": scope, "before": before, "status": to}, output,
             lambda: f"{definition_id} v{version} (scope {scope}): " + (
                 f"already {to}, nothing changed" if before == to else f"{before} -> {to}"))


_lifecycle("deprecate", "DEPRECATED", "Take new instances off VERSION (running ones go on); it must not be current.")
_lifecycle("retire", "RETIRED", "Retire a deprecated VERSION; refused while instances that may still run pin it.")
_lifecycle("reinstate", "AVAILABLE",
           "Make a deprecated or retired VERSION available again (with --app, its plan hash must match the code).")


@definitions_group.command("stranded")
@click.option("--within-minutes", type=Finite(0.01, MAX_SECONDS / 60), default=ops.DEFAULT_STRANDED_WITHIN / 60,
              show_default=True, help="A pin no worker served within this long counts as served by none.")
@click.option("--scope", default=None, type=TEXT, help="Only instances of this scope.")
@output_option
@with_settings
def stranded_command(settings: Settings, within_minutes: float, scope: str | None, output: str) -> None:
    """Instances whose pinned version no live worker has registered: they wait (deferred), never fail."""

    async def go() -> list[dict[str, Any]]:
        async with open_store(settings) as store:
            found = await ops.stranded_report(store.definitions, within_minutes * 60, scope)
            return [{"scope": s.pin.scope, "workflow": s.pin.definition_id, "version": s.pin.version,
                     "plan_hash": s.pin.plan_hash, "instances": s.instances,
                     "deferred_commands": s.deferred_commands,
                     "last_served": s.last_served.isoformat() if s.last_served else None} for s in found]

    rows = run_async(go())
    # A worker that stops cleanly deletes its heartbeat rows: no time on record is "unknown", not "never".
    emit(rows, output, lambda: render_table(
        [[r["workflow"], r["version"], r["plan_hash"][:12], r["instances"], r["deferred_commands"],
          r["last_served"] or "unknown"] for r in rows],
        ["workflow", "version", "plan", "instances", "deferred", "last served"])
        if rows else "no stranded instances: every pinned version is served by a live worker")


def _step_map(pairs: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        old, sep, new = pair.partition("=")
        if not sep or not old or not new:
            raise CliError(f"--step-map takes OLD=NEW, got {pair!r}")
        out[old] = new
    return out


@definitions_group.command("migrate")
@click.argument("instance_ids", nargs=-1, type=TEXT)
@app_option(required=True)
@click.option("--workflow", "definition_id", required=True, type=TEXT, help="The definition id.")
@click.option("--to-version", required=True, type=VERSION, help="The version to move to (in --app).")
@click.option("--from-version", type=VERSION, default=None,
              help="Without INSTANCE_IDS: every instance of this version that may still run.")
@click.option("--scope", default=None, type=TEXT, help="Only instances of this scope.")
@click.option("--step-map", multiple=True, metavar="OLD=NEW", help="Where a step of the old version goes.")
@click.option("--transform", default=None, metavar="MODULE:FUNC", help="A function old state -> new state.")
@click.option("--dry-run", is_flag=True, help="Check every instance and report; change nothing.")
@click.option("--patience", type=Duration(), default=DEFAULT_PATIENCE, show_default=True,
              help="Seconds a migration waits for its turn behind the instance's queued commands before it "
                   "answers refused.")
@output_option
@with_settings
def migrate_command(settings: Settings, instance_ids: tuple[str, ...], registry: Any, definition_id: str,
                    to_version: int, from_version: int | None, scope: str | None, step_map: tuple[str, ...],
                    transform: str | None, dry_run: bool, patience: float, output: str) -> None:
    """Move running instances to another version; each is checked first and answered migrated, refused
    (and why) or skipped (exit 4 when one is refused, in a dry run too)."""
    from stepstone.client import Client  # noqa: PLC0415 - the CLI's other commands need no client

    target = registry.find(definition_id, to_version)
    if target is None:
        raise CliError(f"--app has no {definition_id} v{to_version}")
    if not instance_ids and from_version is None:
        raise CliError("name INSTANCE_IDS, or --from-version for every instance of that version")
    mapping = _step_map(step_map)
    func = import_attribute(transform, "--transform", "myapp.migrations:add_currency") if transform else None

    async def go() -> Any:
        async with open_store(settings) as store:
            client = Client(store, registry, actor="cli")
            try:
                return await client.migrate(list(instance_ids) or None, to=target, definition=definition_id,
                                            from_version=from_version, scope=scope, step_map=mapping,
                                            state_transform=func, dry_run=dry_run, patience=patience)
            finally:
                await client.detach()

    report = run_async(go())
    rows = [{"instance": o.instance_id, "outcome": o.outcome, "reason": o.reason} for o in report.outcomes]
    summary = ", ".join(f"{n} {k}" for k, n in sorted(report.counts.items())) or "no instances"
    emit({"dry_run": dry_run, "counts": report.counts, "instances": rows}, output, lambda: "\n".join(
        [render_table([[r["instance"], r["outcome"], r["reason"]] for r in rows], ["instance", "outcome", "why"]),
         ("dry run: " if dry_run else "") + summary]))
    if report.counts.get("refused"):  # as `repair` does when one could not be acted on
        raise SystemExit(4)


commands = [definitions_group]
