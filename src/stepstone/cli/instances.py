"""Instance commands: start, signal, cancel, retry, show, list.

Each one validates what it was given (JSON, ids, cursors) before it connects, so a bad argument
stores nothing, then calls the same `Client` operation a program would.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import click

from stepstone.authoring.workflow import Registry
from stepstone.cli.app import app_option
from stepstone.cli.common import (
    FREE_TEXT,
    TEXT,
    CliError,
    Duration,
    emit,
    output_option,
    render_table,
    run_async,
    with_settings,
)
from stepstone.cli.connection import open_store
from stepstone.cli.instance_args import describe_error, instance_id_arg, short_json
from stepstone.client import Client, InstanceInfo
from stepstone.client_starts import DEFAULT_START_BATCH
from stepstone.config import Settings
from stepstone.core import json_text
from stepstone.core.failures import traceback_text, without_frames
from stepstone.core.model import WAITING
from stepstone.core.redaction import Redaction
from stepstone.errors import DefinitionNotFound, InvalidInput
from stepstone.ops.history import compensations_shown
from stepstone.ops.repair import saga_unchanged
from stepstone.store.management import open_management

__all__ = ["commands"]

T = TypeVar("T")


# -- argument parsing (before anything touches the database) ---------------------------------------


def parse_json(text: str, what: str) -> Any:
    try:
        return json_text.parse(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{what} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None


def _with_client(settings: Settings, registry: Registry | None, work: Callable[[Client], Awaitable[T]]) -> T:
    async def go() -> T:
        async with open_store(settings) as store:
            client = Client(store, registry)
            client._registry_named = "--app"
            try:
                return await work(client)
            finally:
                await client.detach()

    return run_async(go())
# -- formatting ------------------------------------------------------------------------------------
def _time(value: datetime | None, *, millis: bool = False) -> str:
    if value is None:
        return ""
    text = value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
    return (text[:-3] if millis else text[:-7]) + "Z"
def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value
def describe_wait(info: InstanceInfo) -> str:
    """What a waiting instance waits for, in words."""
    wait = info.waiting_for
    if not isinstance(wait, dict) or info.status != WAITING:
        return ""
    at = _time(info.next_timer_at)
    if wait.get("kind") == "timer":
        return f"timer, fires at {at}" if at else "timer"
    if wait.get("kind") == "task":
        return f"task {wait.get('task_id')} ({' or '.join(sorted(wait.get('decisions') or {}))})"
    if wait.get("kind") == "signal":
        key = f" (key {wait['correlation_key']})" if "correlation_key" in wait else ""
        names = ", ".join(sorted([*(wait.get("signals") or {}),
                                  *(f"message {m}{key}" for m in wait.get("messages") or {})]))
        text = f"signal {names}" if names else "a signal"
        return f"{text} (timeout at {at})" if at else text
    if wait.get("kind") == "external":
        return f"external task {wait.get('task_id')} on topic {wait.get('topic')}"
    return short_json(wait)
def _show_text(info: InstanceInfo, history: list[dict[str, Any]], compensations: list[dict[str, Any]]) -> str:
    rows: list[list[Any]] = [
        ["instance", info.id],
        ["workflow", f"{info.definition_id} v{info.version}"],
        ["status", info.status],
        ["step", info.step or "-"],
    ]
    if info.business_key:
        rows.append(["business key", info.business_key])
    if info.status == WAITING:
        rows.append(["waiting for", describe_wait(info)])
    if info.parked_signals:
        rows.append(["parked signals", info.parked_signals])
    if info.error:
        rows.append(["error", describe_error(info.error)])
    if info.parent_id:
        rows.append(["parent", info.parent_id])
    rows += [["created", _time(info.created_at)], ["updated", _time(info.updated_at)]]
    if info.ended_at:
        rows.append(["ended", _time(info.ended_at)])
    if info.archived_at:
        rows.append(["archived", _time(info.archived_at)])
    table = render_table(
        [[h["seq"], _time(h["at"], millis=True), h["kind"], h.get("position") or "", h["step"] or "",
          short_json(without_frames(h["data"]))] for h in history],
        ["seq", "time", "kind", "position", "step", "data"],
    )
    state = json.dumps(info.state, indent=2, ensure_ascii=False, sort_keys=True)
    parts = [render_table(rows), "", "state", state]
    trace = traceback_text(info.error)
    if trace is not None:  # where the failing handler raised (older failures have no frames)
        parts[1:1] = ["", "traceback", trace]
    branches = [p for p in info.positions if p["path"]]
    if branches:
        parts += ["", "branches", render_table(
            [[p["path"], p["status"], p["step"] or "-", p["visit"]] for p in branches],
            ["position", "status", "step", "visit"],
        )]
    if info.children:
        parts += ["", "children", render_table(
            [[c["id"], c["definition_id"], c["status"], c["position"] or "(root)"] for c in info.children],
            ["instance", "workflow", "status", "from position"],
        )]
    if compensations:  # a saga's: what it completed that can be undone, and what became of each
        parts += ["", "compensations", render_table(
            [[c["step"], c["position"] or "(root)", c["visit"], c["status"], c["attempts"],
              _time(c["completed_at"]), _time(c["compensated_at"]) if c["compensated_at"] else "-",
              describe_error(c["last_error"]) if c["last_error"] else ""] for c in compensations],
            ["step", "position", "visit", "status", "attempts", "completed", "compensated", "last error"],
        )]
    return "\n".join([*parts, "", "history", table])
# -- commands --------------------------------------------------------------------------------------
@click.command("start")
@click.argument("workflow", type=TEXT)
@click.option("--input", "input_text", metavar="JSON", help="The instance's input as a JSON object.")
@click.option(
    "--input-file", type=click.Path(dir_okay=False, allow_dash=True), help="Read the input from a file ('-': stdin)."
)
@click.option(
    "--idempotency-key", type=TEXT, metavar="K",
    help="Starting again with the same key and input returns the same instance.",
)
@click.option("--business-key", type=TEXT, metavar="K",
              help="Unique per workflow while set (e.g. an order number).")
@click.option("--scope", type=TEXT, default="default", show_default=True,
              help="The scope (tenant key) of the instance; its activation picks the version.")
@click.option("--deadline", type=Duration(0), metavar="DURATION",
              help="Time the instance out after this long (seconds, or 90s, 15m, 2h, 30d, 1w): it compensates, "
                   "then ends TIMED_OUT.")
@app_option(required=True)
@output_option
@with_settings
def start_command(
    settings: Settings, registry: Registry, output: str, workflow: str, input_text: str | None,
    input_file: str | None, idempotency_key: str | None, business_key: str | None, scope: str,
    deadline: float | None,
) -> None:
    """Start an instance of WORKFLOW (the version the scope's activation selects, docs/versions.md) and print
    its id. An --input-file of JSON lines (one input per line) starts one instance per line, a thousand
    per statement, and prints their ids in order."""
    if input_text is not None and input_file is not None:
        raise CliError("give --input or --input-file, not both")
    if input_file is not None:
        try:
            text = sys.stdin.read() if input_file == "-" else Path(input_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise CliError(f"cannot read --input-file {input_file}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise CliError(f"--input-file {input_file} is not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at "
                           f"offset {exc.start} (save it as UTF-8)") from None
        source = f"--input-file {input_file}"
        many = input_lines(text, source)
        if many is not None:
            if idempotency_key is not None or business_key is not None:
                raise CliError("--idempotency-key and --business-key name one instance; an --input-file of "
                               f"{len(many):,} lines starts {len(many):,}")
            _known_workflow(registry, workflow)
            _start_many(settings, registry, output, workflow, many, source, scope, deadline)
            return
        data = parse_json(text, source)
    else:
        data = parse_json(input_text, "--input") if input_text is not None else None
    _known_workflow(registry, workflow)

    async def work(client: Client) -> str:
        return await client.start(workflow, data, idempotency_key=idempotency_key, business_key=business_key,
                                  scope=scope, deadline=deadline)

    instance_id = _with_client(settings, registry, work)
    emit({"instance_id": instance_id}, output, lambda: instance_id)
def input_lines(text: str, what: str) -> list[tuple[int, Any]] | None:
    """The inputs of a JSON-lines file (one document per non-empty line), each with its line number, or
    None when the text is one JSON document (which may span lines): a single start."""
    try:
        json.loads(text)
    except json.JSONDecodeError:
        pass
    except RecursionError:
        raise CliError(f"{what} is nested too deeply") from None
    else:
        return None
    lines = [(number, line) for number, line in enumerate(text.splitlines(), start=1) if line.strip()]
    try:
        json.loads(lines[0][1]) if lines else None
    except (json.JSONDecodeError, RecursionError):
        lines = []
    if len(lines) < 2:  # not JSON lines: one document that does not parse, and the error says where
        parse_json(text, what)
    return [(number, parse_json(line, f"{what} line {number}")) for number, line in lines]
def _known_workflow(registry: Registry, workflow: str) -> None:
    if registry.latest(workflow) is None:
        known = ", ".join(sorted({wf.id for wf in registry})) or "none"
        raise CliError(f"{DefinitionNotFound(workflow)} (workflows here: {known})")
def _start_many(settings: Settings, registry: Registry, output: str, workflow: str, lines: list[tuple[int, Any]],
                source: str, scope: str, deadline: float | None) -> None:
    def progress(started: int, total: int) -> None:
        if total > DEFAULT_START_BATCH:
            click.echo(f"started {started:,} of {total:,}", err=True)

    started: dict[int, list[str]] = {}  # a committed batch's first item -> the ids it started

    async def work(client: Client) -> list[str]:
        try:
            return await client.start_many(workflow, [doc for _, doc in lines], scope=scope, deadline=deadline,
                                           on_batch=progress, on_started=started.__setitem__)
        except InvalidInput as exc:  # name the file's line (blank lines are skipped: not the item's number)
            if exc.item is None:
                raise
            raise CliError(f"{source} line {lines[exc.item - 1][0]}: {exc.item_detail}") from None

    try:
        ids = _with_client(settings, registry, work)
    except CliError as exc:  # Ctrl-C, the database gone: the batches committed before stay started
        if not started:
            raise
        raise _part_way(exc, started, lines, output) from None
    emit({"instance_ids": ids}, output, lambda: "\n".join(ids))
def _part_way(exc: CliError, started: dict[int, list[str]], lines: list[tuple[int, Any]], output: str) -> CliError:
    """The error of a file's starts that stopped part-way, once the ids its committed batches started are
    printed (in line order): it names their lines, so that the rest can be started without these twice."""
    spans: list[list[int]] = []  # [first, last] item, adjacent batches as one
    for first in sorted(started):
        last = first + len(started[first]) - 1
        if spans and spans[-1][1] + 1 == first:
            spans[-1][1] = last
        else:
            spans.append([first, last])
    ranges = [[lines[a][0], lines[b][0]] for a, b in spans]
    ids = [instance_id for first in sorted(started) for instance_id in started[first]]
    emit({"instance_ids": ids, "lines_started": ranges}, output, lambda: "\n".join(ids))
    named = " and ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in ranges)
    rest = "; the other lines did not, unless their batch was in flight as it stopped" if len(ids) < len(lines) \
        else ""
    return type(exc)(f"{exc.format_message()}: {len(ids):,} of {len(lines):,} started, lines {named} (their ids "
                     f"are printed, in line order){rest}")
@click.command("signal")
@click.argument("instance_id")
@click.argument("name", type=TEXT)
@click.option("--payload", metavar="JSON", help="The signal's payload as JSON.")
@click.option("--dedup-key", type=TEXT, metavar="K", help="Sending again with the same key applies the signal once.")
@click.option("--position", type=TEXT, metavar="PATH",
              help="A branch's path (see `show`); default: the root.")
@output_option
@with_settings
def signal_command(
    settings: Settings, output: str, instance_id: str, name: str, payload: str | None, dedup_key: str | None,
    position: str | None,
) -> None:
    """Send signal NAME to an instance or one of its branches (parked until it waits for it)."""
    iid = instance_id_arg(instance_id)
    data = parse_json(payload, "--payload") if payload is not None else None
    command_id = _with_client(
        settings, None, lambda c: c.signal(iid, name, data, dedup_key=dedup_key, position=position or "")
    )
    result = {"instance_id": iid, "signal": name, "command_id": command_id}
    emit(result, output, lambda: f"signal {name} sent to {iid} (command {command_id})")
@click.command("cancel")
@click.argument("instance_id")
@click.option("--reason", default="", type=FREE_TEXT, help="Recorded in the history.")
@click.option("--compensate", is_flag=True, help="Compensate the completed steps first (docs/sagas.md).")
@output_option
@with_settings
def cancel_command(settings: Settings, output: str, instance_id: str, reason: str, compensate: bool) -> None:
    """Cancel an instance (repeating it is harmless: an ended instance is left as it is)."""
    iid = instance_id_arg(instance_id)
    done = _with_client(settings, None, lambda c: c.cancellation(iid, reason, compensate=compensate))
    words = {"unchanged": f"{iid} {done.status}: {saga_unchanged(done.status) or 'already ended, nothing to cancel'}"}
    if done.status == "COMPENSATING":
        words["compensating"] = f"{iid} COMPENSATING: the completed steps are undone first, then CANCELLED"
    emit({"instance_id": iid, "status": done.status, "outcome": done.outcome}, output,
         lambda: words.get(done.outcome, f"{iid} {done.status}"))
@click.command("retry")
@click.argument("instance_id")
@output_option
@with_settings
def retry_command(settings: Settings, output: str, instance_id: str) -> None:
    """Run the failed step of a FAILED instance again, or resume the compensation of a COMPENSATION_FAILED
    one where it stopped."""
    iid = instance_id_arg(instance_id)

    async def work(client: Client) -> str:
        await client.retry(iid)
        return (await client.get(iid)).status

    status = _with_client(settings, None, work)
    emit({"instance_id": iid, "status": status}, output, lambda: f"{iid} {status}: retry scheduled")
@click.command("show")
@click.argument("instance_id")
@output_option
@with_settings
def show_command(settings: Settings, output: str, instance_id: str) -> None:
    """Show an instance: where it is, what it waits for, its state and its history."""
    iid = instance_id_arg(instance_id)

    async def work(client: Client) -> tuple[InstanceInfo, list[dict[str, Any]], list[dict[str, Any]]]:
        info = await client.get(iid)
        # As every view shows it (docs/operations.md, Redaction): sensitive values redacted, and a wait's
        # correlation key read from one of them.
        redaction = (await open_management(client.store).redactions([iid])).get(iid, Redaction())
        waiting_for, positions = redaction.shown_waits(info.state, info.waiting_for, info.positions)
        shown = replace(info, state=redaction.shown_state(info.state), waiting_for=waiting_for, positions=positions)
        return shown, await client.history(iid), await client.compensations(iid)

    info, history, compensations = _with_client(settings, None, work)
    compensations = compensations_shown(compensations)
    data = {"instance": _jsonable(asdict(info)), "waiting_for": describe_wait(info) or None,
            "compensations": _jsonable(compensations), "history": _jsonable(history)}
    emit(data, output, lambda: _show_text(info, history, compensations))
commands = [start_command, signal_command, cancel_command, retry_command, show_command]
