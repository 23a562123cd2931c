"""``stepstone schedules`` (create, list, pause, resume, trigger, delete) and ``stepstone limits``
(set, list, remove): the same `Client` operations a program calls (docs/schedules.md)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import click

from stepstone.authoring.workflow import Registry
from stepstone.cli.app import app_option
from stepstone.cli.common import INT4, TEXT, CliError, Duration, emit, output_option, render_table, with_settings
from stepstone.cli.instances import _with_client  # the one way a command opens a client
from stepstone.client import Client
from stepstone.config import Settings
from stepstone.core import json_text
from stepstone.core.pin import DEFAULT_SCOPE
from stepstone.scheduling import Schedule
from stepstone.scheduling.operations import ScheduleInfo
from stepstone.scheduling.schedule import CATCH_UPS, OVERLAPS

__all__ = ["commands"]

def _time(value: datetime | None) -> str:
    return "" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _when(info: ScheduleInfo) -> str:
    spec = info.spec
    if spec.get("cron"):
        zone = spec.get("timezone") or "UTC"
        return f"cron {spec['cron']}" + ("" if zone == "UTC" else f" ({zone})")
    return f"every {spec.get('every_seconds'):g} s"


def _table(infos: list[ScheduleInfo]) -> str:
    if not infos:
        return "no schedules"
    return render_table(
        [[i.name, i.workflow, _when(i), "paused" if i.paused else _time(i.next_fire_at), i.spec.get("overlap"),
          i.spec.get("catch_up"), i.fired, i.skipped, i.last_instance or ""] for i in infos],
        ["name", "workflow", "when", "next", "overlap", "catch-up", "fired", "skipped", "last instance"],
    )


def _json(infos: list[ScheduleInfo]) -> list[dict[str, Any]]:
    return [asdict(i) for i in infos]


@click.group("schedules")
def schedules_group() -> None:
    """Workflows started on a cron expression or an interval; any worker fires them."""


@schedules_group.command("create")
@click.argument("name", type=TEXT)
@click.argument("workflow", type=TEXT)
@click.option("--cron", metavar="EXPR", help="Five-field cron expression, e.g. '0 * * * *'.")
@click.option("--every", type=Duration(0), metavar="DURATION",
              help="A fixed interval instead of --cron (seconds, or 90s, 15m, 2h, 30d, 1w).")
@click.option("--input", "input_text", metavar="JSON", help="The input of every instance it starts.")
@click.option("--timezone", default="UTC", show_default=True, help="The zone --cron is read in.")
@click.option("--overlap", type=click.Choice(OVERLAPS), default="skip", show_default=True,
              help="When the previous instance still runs at a tick.")
@click.option("--catch-up", type=click.Choice(CATCH_UPS), default="one", show_default=True,
              help="Ticks missed while no worker ran: none, the latest one, or all.")
@click.option("--scope", type=TEXT, default=DEFAULT_SCOPE, show_default=True,
              help="The scope (tenant) its instances start in, each on the version a start there selects.")
@app_option(required=False)
@output_option
@with_settings
def create_command(
    settings: Settings, registry: Registry | None, output: str, name: str, workflow: str, cron: str | None,
    every: float | None, input_text: str | None, timezone: str, overlap: str, catch_up: str, scope: str,
) -> None:
    """Create or replace schedule NAME of WORKFLOW (declaring it again unchanged keeps its next tick)."""
    if (cron is None) == (every is None):
        raise CliError("give --cron EXPR or --every DURATION (one of them)")
    try:
        data = json_text.parse(input_text) if input_text is not None else None
    except json.JSONDecodeError as exc:
        raise CliError(f"--input is not valid JSON: {exc.msg}") from None
    schedule = Schedule(name, workflow, cron=cron, every=every, input=data, timezone=timezone,
                        overlap=overlap, catch_up=catch_up, scope=scope)  # type: ignore[arg-type]

    async def create(client: Client) -> tuple[ScheduleInfo, bool]:
        return await client.schedule(schedule), await _registered_nowhere(client, registry, workflow)

    info, nowhere = _with_client(settings, registry, create)
    if nowhere:
        _warn_nowhere(workflow, registry, "the schedule is kept, and its ticks start nothing (a worker logs an "
                                          "error for each) until a version of it is deployed")
    emit(asdict(info), output, lambda: f"schedule {name}: {_when(info)}, next tick {_time(info.next_fire_at)}")


async def _registered_nowhere(client: Client, registry: Registry | None, workflow: str) -> bool:
    """Whether neither the database nor --app has any version of `workflow` (a typo, or code not yet deployed)."""
    if registry is not None and registry.latest(workflow) is not None:
        return False
    return not await client.store.definitions.records(definition_id=workflow)


def _warn_nowhere(workflow: str, registry: Registry | None, consequence: str) -> None:
    """A schedule or limit of a workflow registered nowhere is kept (its code may deploy later): said on stderr."""
    where = "in the database" + ("" if registry is None else " or in --app")
    click.echo(f"warning: no workflow {workflow!r} is registered {where}: {consequence}; "
               "`stepstone definitions list` shows the registered workflows", err=True)


@schedules_group.command("list")
@output_option
@with_settings
def list_command(settings: Settings, output: str) -> None:
    """Every schedule: when it fires next, what it last started, how often it fired and skipped."""
    infos = _with_client(settings, None, lambda c: c.schedules())
    emit(_json(infos), output, lambda: _table(infos))


def _by_name(verb: str, help_text: str, operation: Callable[[Client, str], Awaitable[object]]) -> None:
    """A `schedules VERB NAME` command that runs one operation and says it was done."""

    @schedules_group.command(verb, help=help_text)
    @click.argument("name", type=TEXT)
    @output_option
    @with_settings
    def command(settings: Settings, name: str, output: str) -> None:
        _with_client(settings, None, lambda c: operation(c, name))
        emit({"name": name, verb + "d": True}, output, lambda: f"schedule {name} {verb}d")


_by_name("pause", "Stop firing schedule NAME until it is resumed.", Client.pause_schedule)
_by_name("delete", "Delete schedule NAME (instances it started are not touched).", Client.delete_schedule)


@schedules_group.command("resume")
@click.argument("name", type=TEXT)
@output_option
@with_settings
def resume_command(settings: Settings, name: str, output: str) -> None:
    """Fire schedule NAME again from its next tick (ticks missed while paused do not fire)."""
    info = _with_client(settings, None, lambda c: c.resume_schedule(name))
    emit(asdict(info), output, lambda: f"schedule {name} resumed; next tick {_time(info.next_fire_at)}")


@schedules_group.command("trigger")
@click.argument("name", type=TEXT)
@app_option(required=True)
@output_option
@with_settings
def trigger_command(settings: Settings, registry: Registry, output: str, name: str) -> None:
    """Start schedule NAME's workflow now, outside its ticks, and print the instance id."""
    instance_id = _with_client(settings, registry, lambda c: c.trigger_schedule(name))
    emit({"instance_id": instance_id}, output, lambda: instance_id)


_limit_scope_option = click.option("--scope", default=DEFAULT_SCOPE, show_default=True, type=TEXT,
                                   help="The scope whose instances the limit counts.")


@click.group("limits")
def limits_group() -> None:
    """Flow limits: how many instances of a workflow run at once, and how fast they start."""


@limits_group.command("set")
@click.argument("workflow", type=TEXT)
@click.option("--max-running", type=INT4, metavar="N", help="At most N instances run at once.")
@click.option("--key", metavar="FIELD", help="Per value of 'business_key' or of a top-level state field.")
@click.option("--min-interval", type=Duration(0), metavar="DURATION",
              help="Starts at least this far apart (seconds, or 90s, 15m, 2h, ...).")
@_limit_scope_option
@output_option
@with_settings
def limits_set_command(
    settings: Settings, workflow: str, max_running: int | None, key: str | None, min_interval: float | None,
    scope: str, output: str,
) -> None:
    """Limit WORKFLOW's instances in a scope; those past the limit wait as rows and start in start order."""
    if max_running is None and min_interval is None:
        raise CliError("give --max-running N, --min-interval DURATION or both")

    async def set_limit(client: Client) -> tuple[int, bool]:
        admitted = await client.set_flow_limit(workflow, max_running=max_running, key=key,
                                               min_interval=min_interval, scope=scope)
        return admitted, await _registered_nowhere(client, None, workflow)

    admitted, nowhere = _with_client(settings, None, set_limit)
    if nowhere:
        _warn_nowhere(workflow, None, "the limit is kept, and holds its instances once a version of it is deployed")
    emit({"scope": scope, "workflow": workflow, "admitted": admitted}, output,
         lambda: f"limit set on {workflow}{_in_scope(scope)}" + (
             f"; {admitted} waiting instance(s) admitted" if admitted else ""))


@limits_group.command("list")
@click.option("--scope", default=None, type=TEXT, help="Only this scope's limits (default: every scope's).")
@output_option
@with_settings
def limits_list_command(settings: Settings, scope: str | None, output: str) -> None:
    """Every flow limit, per scope, with how many instances run and wait now."""
    infos = _with_client(settings, None, lambda c: c.flow_limits(scope=scope))
    emit([asdict(i) for i in infos], output, lambda: render_table(
        [[i.workflow, i.scope, i.key or "", i.max_running or "",
          "" if i.min_interval is None else f"{i.min_interval:g} s", i.running, i.waiting] for i in infos],
        ["workflow", "scope", "key", "max running", "min interval", "running", "waiting"]) if infos else "no limits")


@limits_group.command("remove")
@click.argument("workflow", type=TEXT)
@_limit_scope_option
@output_option
@with_settings
def limits_remove_command(settings: Settings, workflow: str, scope: str, output: str) -> None:
    """Remove WORKFLOW's limit in a scope: whatever it held back there starts now."""

    async def remove(client: Client) -> int | None:
        # A name with no limit (a typo) is an error, as for schedules and tokens, not "limit removed".
        limited = await client.flow_limits(workflow, scope=scope)
        return await client.remove_flow_limit(workflow, scope=scope) if limited else None

    released = _with_client(settings, None, remove)
    if released is None:
        where = "" if scope == DEFAULT_SCOPE else f" in scope {scope!r}"
        raise CliError(f"no flow limit on {workflow!r}{where} (`stepstone limits list` shows them)")
    emit({"scope": scope, "workflow": workflow, "released": released}, output,
         lambda: f"limit removed from {workflow}{_in_scope(scope)}; {released} waiting instance(s) released")


def _in_scope(scope: str) -> str:
    """A limit's scope in a line of text: said only when it is not the default scope."""
    return "" if scope == DEFAULT_SCOPE else f" in scope {scope}"


commands = [schedules_group, limits_group]
