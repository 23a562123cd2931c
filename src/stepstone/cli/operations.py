"""Operator commands: find, inspect, history, probe, stuck, retention, repair, replay, db grant.

Every command takes `-o json`; the commands that select instances take the same filters (`--status
--workflow --version --scope --business-key --key-contains --parent --since --until
--updated-since --updated-until --archived`). Bulk changes take `--dry-run` and report a result per
instance. The work is `stepstone.ops`, the same the client and the HTTP API call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import click

from stepstone.cli.common import (
    FREE_TEXT,
    SEQ,
    TEXT,
    VERSION,
    CliError,
    Duration,
    emit,
    is_duration,
    output_option,
    parse_duration,
    run_async,
    shown_duration,
    with_settings,
)
from stepstone.cli.connection import open_store
from stepstone.cli.instance_args import decode_cursor, describe_error, encode_cursor, instance_id_arg
from stepstone.cli.rich_output import progress_bar, rich_table
from stepstone.config import Settings
from stepstone.core.bounds import MAX_BATCH
from stepstone.core.model import STATUSES
from stepstone.core.timestamps import storable
from stepstone.ops import InstanceFilter, Operations
from stepstone.ops.model import BulkReport, HistoryEntry, RetentionReport
from stepstone.ops.retention import OUTBOX_PUBLISHED, STATUS_CLASSES

__all__ = ["commands", "filter_options"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
def _instant(text: str | None, what: str) -> datetime | None:
    """An ISO 8601 time, or a duration meaning that long ago."""
    if text is None:
        return None
    if is_duration(text):
        return datetime.now(UTC) - parse_duration(text, what)
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise CliError(f"{what} {text!r} is neither an ISO 8601 time nor a duration like 2h or 30d") from None
    value = value if value.tzinfo else value.replace(tzinfo=UTC)
    if not storable(value):
        raise CliError(f"{what} {text!r} is outside the instants that can be stored (years 1 to 9999 in UTC)")
    return value


def filter_options(func: F) -> F:
    """The filters every command that selects instances takes (passed as `where`)."""
    options = [
        click.option("--status", "statuses", multiple=True, type=click.Choice(STATUSES, case_sensitive=False),
                     help="Only instances in this status (repeatable)."),
        click.option("--workflow", type=TEXT, metavar="W", help="Only instances of this workflow."),
        click.option("--version", "wf_version", type=VERSION, metavar="N", help="Only this workflow version."),
        click.option("--scope", type=TEXT, metavar="S", help="Only instances of this scope (tenant)."),
        click.option("--business-key", type=TEXT, metavar="K", help="Only the instance with this business key."),
        click.option("--key-contains", type=TEXT, metavar="TEXT", help="Business key contains (any case)."),
        click.option("--parent", metavar="ID", help="Only children of this instance."),
        click.option("--since", metavar="WHEN", help="Created at or after (ISO time, or a duration ago: 2h, 7d)."),
        click.option("--until", metavar="WHEN", help="Created before (ISO time, or a duration ago)."),
        click.option("--updated-since", metavar="WHEN", help="Last changed at or after."),
        click.option("--updated-until", metavar="WHEN", help="Last changed before."),
        click.option("--archived", is_flag=True, help="Include archived instances."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _where(kw: dict[str, Any]) -> InstanceFilter:
    return InstanceFilter(
        status=tuple(s.upper() for s in kw.pop("statuses")), workflow=kw.pop("workflow"),
        version=kw.pop("wf_version"), scope=kw.pop("scope"), business_key=kw.pop("business_key"),
        business_key_contains=kw.pop("key_contains"),
        parent=None if kw.get("parent") is None else instance_id_arg(kw.pop("parent"), "an instance id for --parent"),
        since=_instant(kw.pop("since"), "--since"), until=_instant(kw.pop("until"), "--until"),
        updated_since=_instant(kw.pop("updated_since"), "--updated-since"),
        updated_until=_instant(kw.pop("updated_until"), "--updated-until"), include_archived=kw.pop("archived"),
    )


def _run(settings: Settings, work: Callable[[Operations], Awaitable[T]], actor: str | None = None) -> T:
    async def go() -> T:
        async with open_store(settings) as store:
            return await work(Operations.on(store, actor=actor))

    return run_async(go())


def _t(value: datetime | None) -> str:
    return "" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _json(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _json(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_json(v) for v in data]
    if isinstance(data, datetime):
        return data.isoformat()
    if isinstance(data, timedelta):
        return data.total_seconds()
    return data


actor_option = click.option("--actor", type=TEXT, metavar="NAME", default=None,
                            help="Recorded as who did it [default: $USER].")


def _actor(actor: str | None) -> str | None:
    import getpass  # noqa: PLC0415 - only the changing commands need it

    if actor is not None:
        return actor
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return None


# -- reading ---------------------------------------------------------------------------------------


def _find_command(name: str, summary: str) -> click.Command:
    @click.command(name, help=summary)
    @filter_options
    @click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True, help="Rows per page.")
    @click.option("--after", metavar="CURSOR", help="Continue after the page that printed this cursor.")
    @click.option("--count", "with_count", is_flag=True, help="Also count every match, by status.")
    @output_option
    @with_settings
    def command(settings: Settings, output: str, limit: int, after: str | None, with_count: bool,
                **filters: Any) -> None:
        where = _where(filters)
        position = decode_cursor(after) if after else None

        async def work(ops: Operations) -> tuple[Any, dict[str, int] | None]:
            page = await ops.find(where, after=position, limit=limit)
            return page, (await ops.count(where) if with_count else None)

        page, counts = _run(settings, work)
        cursor = encode_cursor(*page.next_after) if page.next_after else None

        def table() -> str:
            text = rich_table(["id", "workflow", "status", "step", "business key", "created", "updated"], [
                [i.id, f"{i.workflow} v{i.version}", i.status + (" (archived)" if i.archived_at else ""),
                 i.step or "-", i.business_key or "", _t(i.created_at), _t(i.updated_at)] for i in page.items]) \
                if page.items else "no instances"
            if counts is not None:
                text += "\n" + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" ({sum(counts.values())} in all)"
            return text + (f"\nnext page: --after {cursor}" if cursor else "")

        emit({"instances": _json([i.as_dict() for i in page.items]), "next_cursor": cursor, "counts": counts},
             output, table)

    return command


# `list` is `find` under the name users try first: one command, one set of filters.
find_command = _find_command(
    "find", "Find instances by status, workflow, version, scope, business key, parent and time; newest first.")
list_command = _find_command("list", "List instances, newest first, a page at a time (the filters of `find`).")


@click.command("inspect")
@click.argument("instance_id")
@output_option
@with_settings
def inspect_command(settings: Settings, output: str, instance_id: str) -> None:
    """Everything about one instance: positions and what they wait for, open commands, timers, children,
    outbox events and any retry in progress (sensitive values redacted)."""
    iid = instance_id_arg(instance_id)
    d = _run(settings, lambda ops: ops.detail(iid))

    def table() -> str:
        out = [rich_table(["", ""], [["id", d.id], ["workflow", f"{d.workflow} v{d.version} (scope {d.scope})"],
                                     ["status", d.status + (f", archived {_t(d.archived_at)}" if d.archived_at
                                                            else "")],
                                     *([["error", describe_error(d.error)]] if d.error else []),
                                     ["business key", d.business_key or ""], ["created", _t(d.created_at)],
                                     ["updated", _t(d.updated_at)]], header=False)]
        out += [r.describe() for r in d.retrying]
        out.append(rich_table(["position", "status", "step", "visit", "waits for"], [
            [p["path"] or "(root)", p["status"], p["step"] or "-", p["visit"],
             (p.get("wait") or {}).get("kind", "") if isinstance(p.get("wait"), dict) else ""]
            for p in d.positions], title="positions"))
        if d.commands or d.timers:
            out.append(rich_table(["id", "kind", "state", "position", "step", "attempt", "available", "actor",
                                   "last error"], [
                [c["id"], c["kind"] + (f" {c['name']}" if c["name"] else ""), c["state"], c["position"] or "(root)",
                 c["step"] or "", c["attempt"], _t(c["available_at"]), c["actor"] or "", c["last_error"] or ""]
                for c in [*d.commands, *d.timers]], title="open commands and timers"))
        if d.children:
            out.append(rich_table(["child", "workflow", "status"], [
                [c["id"], c["definition_id"], c["status"]] for c in d.children], title="children"))
        if d.outbox:
            out.append(rich_table(["event", "type", "key", "state"], [
                [o["id"], o["type"], o["key"] or "", "published" if o["published_at"] else
                 ("dead" if o["dead_at"] else "pending")] for o in d.outbox], title="outbox"))
        return "\n".join(out)

    emit(_json(d.as_dict()), output, table)


@click.command("history")
@click.argument("instance_id")
@click.option("--failed", "failed_only", is_flag=True,
              help="Only what went wrong: failed steps and attempts, dead letters, deadlines passed.")
@click.option("--after", type=SEQ, default=0, help="Entries after this sequence number.")
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True)
@output_option
@with_settings
def history_command(settings: Settings, output: str, instance_id: str, failed_only: bool, after: int,
                    limit: int) -> None:
    """An instance's history: who decided, on which command, where, what came of it, and the patch."""
    iid = instance_id_arg(instance_id)
    page = _run(settings, lambda ops: ops.history(iid, after=after, limit=limit, failed_only=failed_only))

    def patch_text(patch: list[Any] | None) -> str:
        return ", ".join(f"{op.get('op')} {op.get('path')}" for op in patch or [])

    def command(e: HistoryEntry) -> str:
        return f"{e.command_kind or 'command'} {e.command_id}" if e.command_id else ""

    def table() -> str:
        text = rich_table(["seq", "at", "kind", "position", "step", "outcome", "actor", "command", "patch"], [
            [e.seq, _t(e.at), e.kind, e.position or "", e.step or "", e.outcome,
             e.actor.describe() if e.actor else "", command(e), patch_text(e.patch)]
            for e in page.entries]) if page.entries else "no entries"
        return text + (f"\nnext page: --after {page.next_after}" if page.next_after else "")

    emit(_json(page.as_dict()), output, table)


@click.command("probe")
@click.argument("instance_id", required=False)
@filter_options
@output_option
@with_settings
def probe_command(settings: Settings, output: str, instance_id: str | None, **filters: Any) -> None:
    """Is anything in flight or claimable now (for one instance, the instances the filters keep, or all)?
    Exit 3 when not idle."""
    iid = None if instance_id is None else instance_id_arg(instance_id)
    where = _where(filters)
    report = _run(settings, lambda ops: ops.probe(iid, where=where))

    def table() -> str:
        head = (f"{'idle' if report.idle else 'busy'}: {len(report.in_flight)} in flight, "
                f"{len(report.claimable)} claimable now, {len(report.deferred)} deferred, "
                f"{len(report.parked)} parked, {len(report.waiting)} waiting")
        if report.more:
            head += " (more are open: the first of each are listed: narrow the filters)"
        lines = [head]
        rows = [[r["instance_id"], r["id"], r["kind"], r["state"], r["position"] or "(root)", _t(r["available_at"]),
                 kind] for kind, group in (("in flight", report.in_flight), ("claimable", report.claimable),
                                           ("deferred", report.deferred), ("parked", report.parked),
                                           ("waiting", report.waiting)) for r in group]
        if rows:
            lines.append(rich_table(["instance", "command", "kind", "state", "position", "available", "is"], rows))
        return "\n".join(lines)

    emit(_json(report.as_dict()), output, table)
    if not report.idle:
        raise SystemExit(3)


@click.command("stuck")
@click.option("--older-than", type=Duration(), default="15m", show_default=True,
              help="Commands open for longer than this count as stuck.")
@filter_options
@output_option
@with_settings
def stuck_command(settings: Settings, output: str, older_than: float, **filters: Any) -> None:
    """Dead letters, steps retrying, and commands open for longer than a threshold (of the instances the
    filters keep, or of all)."""
    threshold = timedelta(seconds=older_than)
    where = _where(filters)
    report = _run(settings, lambda ops: ops.stuck(threshold, where=where))

    def table() -> str:
        if not report.items:
            return "nothing stuck"
        head = (f"{report.count('dead letter')} dead letter(s), {report.count('retrying')} retrying, "
                f"{report.count('old')} open longer than {shown_duration(older_than)}")
        if report.more:
            head += f" (more are stuck: the first {len(report.items):,} are shown: narrow the filters)"
        return head + "\n" + rich_table(["instance", "workflow", "command", "kind", "step", "attempt", "why",
                                         "since", "last error"], [
            [i.instance_id, i.workflow, i.command_id, i.kind, i.step or "", i.attempt, i.reason, _t(i.since),
             (i.last_error or "")[:80]] for i in report.items])

    emit(_json(report.as_dict()), output, table)


# -- retention -------------------------------------------------------------------------------------


@click.group("retention")
def retention_group() -> None:
    """Retention: policies per workflow and status class; archive, then purge, in bounded batches."""


def _window(value: timedelta | None) -> str:
    if value is None:
        return "never"
    days = value.total_seconds() / 86_400
    if days >= 1:
        return f"{days:g} day" + ("" if days == 1 else "s")
    return f"{value.total_seconds():g} s"


@retention_group.command("policies")
@output_option
@with_settings
def policies_command(settings: Settings, output: str) -> None:
    """The retention windows: per workflow, '*' being the default."""
    rows = _run(settings, lambda ops: ops.retention_policies())
    emit(_json(rows), output, lambda: rich_table(["workflow", "status class", "archive after", "purge after"], [
        [r["workflow"], r["status_class"], _archive(r),
         "" if r["retain_for"] is None or r["status_class"] == OUTBOX_PUBLISHED
         else _window(r["purge_after"]) + " later"] for r in rows]))


def _archive(row: dict[str, Any]) -> str:
    """What a policy's first window does: published outbox rows are dropped, not archived."""
    if row["status_class"] == OUTBOX_PUBLISHED:
        return f"dropped after {_window(row['retain_for'])}" if row["retain_for"] is not None else "never dropped"
    return _window(row["retain_for"])


def _policy_text(row: dict[str, Any]) -> str:
    head = f"{row['workflow']} {row['status_class']}: "
    if row["status_class"] == OUTBOX_PUBLISHED:
        return head + "published outbox rows " + _archive(row)
    return head + f"archive after {_window(row['retain_for'])}, purge {_window(row['purge_after'])} later"


@retention_group.command("set")
@click.argument("workflow", type=TEXT)
@click.argument("status_class", type=click.Choice(STATUS_CLASSES))
@click.argument("window", type=Duration(never=True), metavar="WINDOW|never")
@click.option("--purge-after", type=Duration(), help="How long an archived instance is kept [default 1d].")
@output_option
@with_settings
def set_policy_command(settings: Settings, output: str, workflow: str, status_class: str, window: float | None,
                       purge_after: float | None) -> None:
    """Set a window: `stepstone retention set '*' completed 14d` ('never' keeps them)."""
    retain = None if window is None else timedelta(seconds=window)
    purge = None if purge_after is None else timedelta(seconds=purge_after)
    row = _run(settings, lambda ops: ops.set_retention_policy(workflow, status_class, retain, purge))
    emit(_json(row), output, lambda: _policy_text(row))


def _retention_text(r: RetentionReport) -> str:
    if not r.ran:
        return "another retention sweep holds the lock; nothing done"
    verb = "would " if r.dry_run else ""
    return "\n".join([
        rich_table(["", "instances"], [
            [f"{verb}archive", r.archived], [f"{verb}purge", r.purged], ["held back: unsent event", r.held_unsent],
            ["held back: dead-lettered event", r.held_dead], ["skipped: busy (locked or leased)", r.skipped_busy],
            ["skipped: active command", r.skipped_active]], header=False),
        (f"{verb}drop {r.outbox_purged} published outbox row(s); {verb}expire {r.messages_expired} buffered "
         f"message(s) past their TTL; {r.batches} batch(es) in {r.seconds:.2f} s"),
    ])


@retention_group.command("run")
@click.option("--dry-run", is_flag=True, help="Count what would go, change nothing.")
@click.option("--batch-size", type=click.IntRange(1, MAX_BATCH), default=500, show_default=True)
@click.option("--workflow", type=TEXT, metavar="W", help="Only instances of this workflow.")
@click.option("--scope", type=TEXT, metavar="S", help="Only instances of this scope (tenant).")
@output_option
@with_settings
def retention_run_command(settings: Settings, output: str, dry_run: bool, batch_size: int, workflow: str | None,
                          scope: str | None) -> None:
    """Archive instances past their window, purge archived ones past theirs, drop old published events.
    Instances with an unsent or dead-lettered event are never purged: the report says how many.
    `--workflow` and `--scope` narrow the instances swept (each status class keeps its policy's window)."""
    with progress_bar("retention", None, enabled=output != "json") as advance:
        def progress(_phase: str, report: RetentionReport) -> None:
            advance(report.archived + report.purged)

        report = _run(settings, lambda ops: ops.retention_run(dry_run=dry_run, batch_size=batch_size,
                                                              progress=progress, workflow=workflow, scope=scope))
    emit(_json(report.as_dict()), output, lambda: _retention_text(report))


# -- repair ----------------------------------------------------------------------------------------


@click.group("repair")
def repair_group() -> None:
    """Retry or cancel instances in bulk (ids or a filter), with a dry run and a result per instance."""


def _bulk_text(r: BulkReport) -> str:
    if r.dry_run:  # it counts the selection; what each one answers shows in the real run
        takes = {"retry": "a retry takes only FAILED and COMPENSATION_FAILED ones",
                 "cancel": "a cancel leaves ended ones as they are"}.get(r.action, "")
        return f"dry run: {r.matched} instance(s) selected for {r.action}" + (f" ({takes})" if takes else "")
    lines = [f"{r.action}: {r.matched} matched, {r.succeeded} succeeded, {r.failed} failed"]
    failed = [i for i in r.items if not i.ok]
    if failed:
        lines.append(rich_table(["instance", "outcome", "why"], [[i.id, i.outcome, i.reason or ""]
                                                                  for i in failed[:200]]))
        if len(failed) > 200:
            lines.append(f"... and {len(failed) - 200} more (-o json lists every one)")
    return "\n".join(lines)


def _bulk(settings: Settings, output: str, action: str, ids: tuple[str, ...], filters: dict[str, Any],
          run: Callable[[Operations, list[str] | None, InstanceFilter | None, Any], Awaitable[BulkReport]],
          actor: str | None) -> None:
    where = _where(filters)
    given = [instance_id_arg(i) for i in ids]
    if given and where != InstanceFilter():
        raise CliError("give instance ids or filters, not both")
    if not given and not where.narrows:  # --archived alone widens: it names no instance
        raise CliError(f"give instance ids or at least one filter (e.g. --status FAILED) to {action}")
    with progress_bar(action, None, enabled=output != "json") as advance:
        report = _run(settings, lambda ops: run(ops, given or None, None if given else where,
                                                lambda done, _total: advance(done)), _actor(actor))
    emit(_json(report.as_dict()), output, lambda: _bulk_text(report))
    if report.failed:
        raise SystemExit(4)


@repair_group.command("retry")
@click.argument("ids", nargs=-1)
@filter_options
@click.option("--dry-run", is_flag=True, help="Count the matches, change nothing.")
@actor_option
@output_option
@with_settings
def repair_retry_command(settings: Settings, output: str, ids: tuple[str, ...], dry_run: bool, actor: str | None,
                         **filters: Any) -> None:
    """Retry the failed step of the given instances, or of every one the filters match (exit 4 when one
    could not be retried)."""
    _bulk(settings, output, "retry", ids, filters,
          lambda ops, i, w, p: ops.retry(i, where=w, dry_run=dry_run, progress=p), actor)


@repair_group.command("cancel")
@click.argument("ids", nargs=-1)
@filter_options
@click.option("--reason", default="", type=FREE_TEXT, help="Recorded in each history.")
@click.option("--compensate", is_flag=True, help="Compensate each one's completed steps first (docs/sagas.md).")
@click.option("--dry-run", is_flag=True, help="Count the matches, change nothing.")
@actor_option
@output_option
@with_settings
def repair_cancel_command(settings: Settings, output: str, ids: tuple[str, ...], reason: str, compensate: bool,
                          dry_run: bool, actor: str | None, **filters: Any) -> None:
    """Cancel the given instances, or every one the filters match."""
    _bulk(settings, output, "cancel", ids, filters,
          lambda ops, i, w, p: ops.cancel(i, where=w, reason=reason, dry_run=dry_run, progress=p,
                                          compensate=compensate), actor)


@click.command("replay")
@click.option("--instance", "instance_id", required=True, metavar="ID", help="The instance to replay.")
@click.option("--from", "step", required=True, type=TEXT, metavar="STEP", help="The step to run again.")
@actor_option
@output_option
@with_settings
def replay_command(settings: Settings, output: str, instance_id: str, step: str, actor: str | None) -> None:
    """Run STEP again with the state the instance had when it last reached it (a new attempt; the old
    path stays in history). The runbook for an instance whose compensation failed."""
    iid = instance_id_arg(instance_id)
    result = _run(settings, lambda ops: ops.replay(iid, step), _actor(actor))
    via = (f"step {result.requested_step} ran in a branch of fork {result.from_step}, so every branch runs "
           f"again; " if result.requested_step not in ("", result.from_step) else "")
    emit(_json(result.as_dict()), output,
         lambda: f"{via}replaying {result.id} from step {result.from_step} (history entry {result.from_seq}), "
                 f"visit {result.visit}: {result.status}")


# -- least privilege -------------------------------------------------------------------------------


@click.command("grant")
@click.argument("role", type=TEXT)
@click.option("--read-only", is_flag=True, help="A role for dashboards: read every row, change none.")
@click.option("--apply", "apply_", is_flag=True, help="Run the statements (as the schema owner) instead of "
                                                      "printing them.")
@output_option
@with_settings
def grant_command(settings: Settings, output: str, role: str, read_only: bool, apply_: bool) -> None:
    """Print (or apply) the grants of a runtime role: USAGE on the schema, DML on its tables, EXECUTE on its
    functions, and no DDL; with --read-only, SELECT only."""

    async def work(ops: Operations) -> list[str]:
        if apply_:
            return await ops.apply_grants(role, read_only=read_only)
        return await ops.grants(role, read_only=read_only)

    statements = _run(settings, work)
    data = {"role": role, "read_only": read_only, "applied": apply_, "statements": statements}
    emit(data, output, lambda: "\n".join(statements))
    if apply_ and output == "table":
        click.echo(f"-- applied: {role} is a {'read-only' if read_only else 'runtime'} role of {settings.schema}",
                   err=True)


commands = [find_command, list_command, inspect_command, history_command, probe_command, stuck_command, retention_group,
            repair_group, replay_command]
