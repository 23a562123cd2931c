"""``stepstone tasks``: the inbox and the operations on human tasks.

Every command that changes a task names who does it (``--as USER``, env STEPSTONE_ACTOR) and, where
candidate groups matter, the user's groups (``--group``, repeatable); ``--admin`` overrides the
assignee and candidate checks and is recorded in the history. ``-o json`` on every command.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from typing import Any, TypeVar, cast

import click

from stepstone.authoring.workflow import Registry
from stepstone.cli.app import app_option
from stepstone.cli.common import (
    FREE_TEXT,
    INT4,
    TEXT,
    VERSION,
    CliError,
    emit,
    output_option,
    render_table,
    with_settings,
)
from stepstone.cli.instances import _jsonable, _time, _with_client, parse_json
from stepstone.client import Client
from stepstone.client_task_filters import INBOX_MODES
from stepstone.client_tasks import SavedTaskFilter, TaskCompletion, TaskFilter, TaskInfo, TaskPage
from stepstone.config import Settings
from stepstone.core.pin import DEFAULT_SCOPE
from stepstone.store.management import open_management

__all__ = ["commands"]

T = TypeVar("T")
ACTOR_ENV = "STEPSTONE_ACTOR"


def _actor(value: str | None) -> str:
    who = value or os.environ.get(ACTOR_ENV)
    if not who:
        raise CliError(f"who does this? pass --as USER or set {ACTOR_ENV}")
    return who


def _actor_option(func: Callable[..., T]) -> Callable[..., T]:
    return click.option("--as", "actor", type=TEXT, metavar="USER",
                        help=f"Who does it (recorded in the history) [env {ACTOR_ENV}].")(func)


def _groups_option(func: Callable[..., T]) -> Callable[..., T]:
    return click.option("--group", "groups", type=TEXT, multiple=True, metavar="G",
                        help="A group the user belongs to (repeat for several).")(func)


def _old_user_option(func: Callable[..., T]) -> Callable[..., T]:
    """`--user`, the spelling `list`, `count` and `filters` took for `--as`: still taken, not shown."""
    return click.option("--user", "old_user", type=TEXT, hidden=True)(func)


def _one_user(user: str | None, old_user: str | None) -> str | None:
    if user is not None and old_user is not None and user != old_user:
        raise CliError("--as and --user name one user (--user is the older spelling of --as): give one")
    return user or old_user


def _admin_option(func: Callable[..., T]) -> Callable[..., T]:
    return click.option("--admin", is_flag=True, help="Override the assignee and candidate checks (recorded).")(func)


def _run(settings: Settings, registry: Registry | None, work: Callable[[Client], Awaitable[T]]) -> T:
    """`work` on a client; the tasks it answers (a task, a page, a completion) as every view shows them."""
    async def shown(client: Client) -> T:
        return await _shown(client, await work(client))

    return _with_client(settings, registry, shown)


async def _shown(client: Client, result: T) -> T:
    """The result with its tasks' shown fields and completion payloads redacted, as the API and the UI show
    them (docs/operations.md, Redaction): the task row keeps them whole."""
    tasks: list[TaskInfo] = (
        result.tasks if isinstance(result, TaskPage) else [result.task] if isinstance(result, TaskCompletion)
        else [result] if isinstance(result, TaskInfo) else [])
    if not tasks:
        return result
    rows = await open_management(client.store).shown_tasks([vars(t) for t in tasks])
    shown: list[TaskInfo] = [replace(t, data=r["data"], completion=r["completion"])
                             for t, r in zip(tasks, rows, strict=True)]
    if isinstance(result, TaskPage):
        return cast(T, replace(result, tasks=shown))
    if isinstance(result, TaskCompletion):
        return cast(T, replace(result, task=shown[0]))
    return cast(T, shown[0])


def _task_json(task: TaskInfo) -> dict[str, Any]:
    data: dict[str, Any] = _jsonable(asdict(task))
    return data


def _task_text(task: TaskInfo) -> str:
    rows: list[list[Any]] = [
        ["task", task.id], ["title", task.title], ["status", task.status],
        ["instance", task.instance_id + (f" (position {task.position})" if task.position else "")],
        ["step", f"{task.step} (visit {task.visit})"], ["workflow", task.definition_id],
        ["assignee", task.assignee or "-"], ["owner", task.owner or "-"],
        ["candidates", ", ".join([*task.candidate_users, *(f"group:{g}" for g in task.candidate_groups)]) or "-"],
        ["priority", task.priority], ["decisions", ", ".join(task.decisions)],
    ]
    if task.delegation:
        rows.append(["delegation", task.delegation])
    if task.description:
        rows.append(["description", task.description])
    rows += [[k, _time(v)] for k, v in (("due", task.due_at), ("follow up", task.follow_up_at),
                                         ("reminded", task.reminded_at), ("escalated", task.escalated_at)) if v]
    shown = json.dumps(_jsonable(task.data), ensure_ascii=False, sort_keys=True)
    rows.append(["shown data", f"{shown} (version {task.state_version})"])
    if isinstance(task.completion, dict):
        rows.append(["completion", f"{task.completion.get('decision')} by {task.completion.get('actor')}"])
    return render_table(rows)


def _inbox_table(tasks: list[TaskInfo], cursor: str | None) -> str:
    if not tasks:
        return "no open tasks"
    text = render_table(
        [[t.id, t.title, t.status, t.assignee or ("group:" + ",".join(t.candidate_groups) if t.candidate_groups
                                                  else "-"), t.priority, _time(t.due_at), t.instance_id]
         for t in tasks],
        ["task", "title", "status", "assignee", "priority", "due", "instance"],
    )
    return text + (f"\nnext page: --after {cursor}" if cursor else "")


_WHEN = click.DateTime(["%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%d"])


def _filter_options(func: Callable[..., T]) -> Callable[..., T]:
    """The inbox's narrowing options; a command receives them as keyword arguments for `_where`."""
    for option in reversed([
        click.option("--workflow", type=TEXT, metavar="W", help="Only tasks of this workflow."),
        click.option("--priority-at-least", type=INT4, metavar="N", help="Only tasks of this priority or higher."),
        click.option("--due-before", type=_WHEN, metavar="WHEN", help="Only tasks due before this (ISO 8601)."),
        click.option("--candidate-group", type=TEXT, metavar="G", help="Only tasks offered to this group."),
        click.option("--text", type=FREE_TEXT, metavar="T", help="Only tasks whose title contains this."),
        click.option("--follow-up-before", type=_WHEN, metavar="WHEN",
                     help="Hide tasks whose follow-up date is after this (ISO 8601)."),
        click.option("--hide-later-follow-ups", is_flag=True,
                     help="Hide tasks whose follow-up date is still to come (the database's now)."),
    ]):
        func = option(func)
    return func


def _inbox_options(func: Callable[..., T]) -> Callable[..., T]:
    """Whose inbox, how, and its filters: the options of `list` and `count`."""
    for option in reversed([
        click.option("--as", "user", type=TEXT, metavar="USER",
                     help=f"Whose inbox [env {ACTOR_ENV}, which does not narrow --mode all]."),
        click.option("--group", "groups", type=TEXT, multiple=True, metavar="G",
                     help="A group of the user (repeat for several)."),
        click.option("--mode", type=click.Choice(INBOX_MODES), default=None,
                     help="inbox (default): assigned to the user or offered to them; all: every open task "
                          "(with --as or --group, theirs alone)."),
        click.option("--filter", "saved_filter", type=TEXT, metavar="NAME",
                     help="Use the user's saved filter NAME (`stepstone tasks filters`) for mode and filters."),
        click.option("--scope", type=TEXT, metavar="S",
                     help="Only tasks of this scope; with --filter, the scope the filter was saved in."),
    ]):
        func = option(func)
    return _filter_options(_old_user_option(func))


def _where(**options: Any) -> TaskFilter:
    values = {k: v for k, v in options.items() if v is not None}
    if "text" in values:
        values["text"] = values["text"] or None
    return TaskFilter(**values)


def _inbox_call(user: str | None, mode: str | None, saved_filter: str | None, scope: str | None,
                filters: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `Client.tasks` / `count_tasks` for the inbox options."""
    user = _one_user(user, filters.pop("old_user"))
    # STEPSTONE_ACTOR names who acts; in mode all a user narrows "every open task" to theirs: only --as does
    who = user or (None if mode == "all" else os.environ.get(ACTOR_ENV) or None)
    if who is None and mode != "all":
        raise CliError(f"whose inbox? pass --as USER or set {ACTOR_ENV}")
    if saved_filter is None:
        return {"user": who, "mode": mode, "where": _where(scope=scope, **filters)}
    if mode is not None or any(v not in (None, False) for v in filters.values()):
        raise CliError("--filter brings its own mode and filters: pass only --user, --group and --scope with it")
    return {"user": who, "saved_filter": saved_filter, "scope": scope}


@click.group("tasks")
def tasks_group() -> None:
    """Human tasks: the inbox, claim, complete, reassign, delegate (docs/tasks.md)."""


@tasks_group.command("list")
@_inbox_options
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True, help="Rows per page.")
@click.option("--after", metavar="CURSOR", help="Continue after the page that printed this cursor.")
@output_option
@with_settings
def list_command(settings: Settings, output: str, user: str | None, groups: tuple[str, ...], mode: str | None,
                 saved_filter: str | None, scope: str | None, limit: int, after: str | None,
                 **filters: Any) -> None:
    """List open tasks in inbox order (priority, then oldest), a page at a time."""
    call = _inbox_call(user, mode, saved_filter, scope, filters)
    page = _run(settings, None, lambda c: c.tasks(groups=groups, after=after, limit=limit, **call))
    emit({"tasks": [_task_json(t) for t in page.tasks], "next_cursor": page.next_cursor}, output,
         lambda: _inbox_table(page.tasks, page.next_cursor))


@tasks_group.command("count")
@_inbox_options
@output_option
@with_settings
def count_command(settings: Settings, output: str, user: str | None, groups: tuple[str, ...], mode: str | None,
                  saved_filter: str | None, scope: str | None, **filters: Any) -> None:
    """Count the open tasks `list` would show, without fetching them."""
    call = _inbox_call(user, mode, saved_filter, scope, filters)
    n = _run(settings, None, lambda c: c.count_tasks(groups=groups, **call))
    emit({"count": n}, output, lambda: str(n))


@tasks_group.command("show")
@click.argument("task_id", type=TEXT)
@output_option
@with_settings
def show_command(settings: Settings, output: str, task_id: str) -> None:
    """Show one task: who holds it, what it shows, what it takes."""
    task = _run(settings, None, lambda c: c.task(task_id))
    emit(_task_json(task), output, lambda: _task_text(task))


def _changed(output: str, task: TaskInfo, what: str) -> None:
    emit(_task_json(task), output, lambda: f"task {task.id} {what}: assignee {task.assignee or '-'}")


@tasks_group.command("claim")
@click.argument("task_id", type=TEXT)
@_actor_option
@_groups_option
@_admin_option
@output_option
@with_settings
def claim_command(settings: Settings, output: str, task_id: str, actor: str | None, groups: tuple[str, ...],
                  admin: bool) -> None:
    """Take a task as its assignee (a task someone else holds is refused unless --admin)."""
    who = _actor(actor)
    task = _run(settings, None, lambda c: c.claim_task(task_id, actor=who, groups=groups, admin=admin))
    _changed(output, task, "claimed")


def _give_back(op: str) -> Callable[..., None]:
    """unclaim (back to the candidates) and resolve (a delegated task back to its owner)."""

    @click.argument("task_id", type=TEXT)
    @_actor_option
    @_admin_option
    @output_option
    @with_settings
    def command(settings: Settings, output: str, task_id: str, actor: str | None, admin: bool) -> None:
        who = _actor(actor)

        async def work(client: Client) -> TaskInfo:
            method = client.unclaim_task if op == "unclaim" else client.resolve_task
            return await method(task_id, actor=who, admin=admin)

        _changed(output, _run(settings, None, work), f"{op}ed" if op == "unclaim" else "resolved")

    return command


tasks_group.command("unclaim", help="Give a task back to its candidates.")(_give_back("unclaim"))
tasks_group.command("resolve", help="Hand a delegated task back to its owner.")(_give_back("resolve"))


def _handover(op: str) -> Callable[..., None]:
    @click.argument("task_id", type=TEXT)
    @click.argument("to", type=TEXT)
    @_actor_option
    @click.option("--reason", default="", type=FREE_TEXT, help="Recorded in the history.")
    @click.option("--idempotency-key", type=TEXT, metavar="K", help="Repeating it with the same key changes nothing.")
    @_admin_option
    @output_option
    @with_settings
    def command(settings: Settings, output: str, task_id: str, to: str, actor: str | None, reason: str,
                idempotency_key: str | None, admin: bool) -> None:
        who = _actor(actor)

        async def work(client: Client) -> TaskInfo:
            method = client.reassign_task if op == "reassign" else client.delegate_task
            return await method(task_id, to, actor=who, reason=reason, idempotency_key=idempotency_key, admin=admin)

        _changed(output, _run(settings, None, work), f"{op}d" if op.endswith("e") else f"{op}ed")

    return command


tasks_group.command("reassign", help="Give a task to user TO (its assignee, owner or an admin may).")(
    _handover("reassign"))
tasks_group.command("delegate", help="Delegate a task to user TO; `resolve` gives it back to its owner.")(
    _handover("delegate"))


@tasks_group.command("complete")
@click.argument("task_id", type=TEXT)
@click.argument("decision", type=TEXT)
@click.option("--payload", metavar="JSON", help="The decision's payload as JSON.")
@click.option("--reviewed-version", type=VERSION, metavar="N",
              help="The version of the shown data you reviewed (tasks that require version stability).")
@click.option("--idempotency-key", type=TEXT, metavar="K",
              help="Repeating it with the same key completes once; a completion given back is made again.")
@_actor_option
@_groups_option
@_admin_option
@app_option(required=False)
@output_option
@with_settings
def complete_command(settings: Settings, registry: Registry | None, output: str, task_id: str, decision: str,
                     payload: str | None, reviewed_version: int | None, idempotency_key: str | None,
                     actor: str | None, groups: tuple[str, ...], admin: bool) -> None:
    """Complete a task with DECISION; a worker then moves its instance on. With --app the payload is
    checked by the decision's model, else by its JSON Schema in the task's form."""
    who = _actor(actor)
    data = parse_json(payload, "--payload") if payload is not None else None
    done = _run(settings, registry, lambda c: c.complete_task(
        task_id, decision, data, actor=who, groups=groups, idempotency_key=idempotency_key,
        reviewed_version=reviewed_version, admin=admin))
    result = {"task": _task_json(done.task), "command_id": done.command_id, "duplicate": done.duplicate}
    emit(result, output, lambda: f"task {done.task.id} {decision} by {who}: {done.task.status}"
         + (" (repeated: nothing new recorded)" if done.duplicate else f" (command {done.command_id})"))


@tasks_group.command("reassign-all")
@click.argument("from_user", type=TEXT)
@click.argument("to_user", type=TEXT)
@_actor_option
@click.option("--reason", default="", type=FREE_TEXT, help="Recorded in each task's history.")
@click.option("--dry-run", is_flag=True, help="Count what would move; change nothing.")
@output_option
@with_settings
def reassign_all_command(settings: Settings, output: str, from_user: str, to_user: str, actor: str | None,
                         reason: str, dry_run: bool) -> None:
    """Move every open task of FROM_USER to TO_USER (an absent colleague's)."""
    who = _actor(actor)
    done = _run(settings, None, lambda c: c.reassign_all_tasks(from_user, to_user, actor=who, reason=reason,
                                                               dry_run=dry_run))
    verb = "would move" if dry_run else "moved"
    emit(asdict(done), output, lambda: f"{verb} {done.reassigned} task(s) from {from_user} to {to_user}"
         + (f"; {done.skipped} skipped (being completed)" if done.skipped else ""))


@tasks_group.group("filters")
def filters_group() -> None:
    """Saved inbox filters: one user's named inboxes in one scope (`tasks list --filter NAME`)."""


def _filter_owner_options(func: Callable[..., T]) -> Callable[..., T]:
    func = click.option("--scope", type=TEXT, default=DEFAULT_SCOPE, show_default=True, metavar="S",
                        help="The scope (tenant key) the filter belongs to; it shows only that scope's tasks.")(func)
    return click.option("--as", "actor", type=TEXT, metavar="USER",
                        help=f"Whose filter [env {ACTOR_ENV}].")(_old_user_option(func))


def _saved_json(saved: SavedTaskFilter) -> dict[str, Any]:
    data: dict[str, Any] = _jsonable(asdict(saved))
    return data


def _saved_line(saved: SavedTaskFilter) -> str:
    narrowing = ", ".join(f"{k}={v}" for k, v in asdict(saved.where).items()
                          if v not in (None, False) and k != "scope")
    return f"{saved.name}: mode {saved.mode}" + (f"; {narrowing}" if narrowing else "")


@filters_group.command("save")
@click.argument("name", type=TEXT)
@_filter_owner_options
@click.option("--mode", type=click.Choice(INBOX_MODES), default="inbox", show_default=True, help="The inbox mode.")
@_filter_options
@output_option
@with_settings
def filters_save_command(settings: Settings, output: str, name: str, old_user: str | None, actor: str | None,
                         scope: str, mode: str, **filters: Any) -> None:
    """Save (or replace) the inbox filter NAME: its mode and the filter options given."""
    owner = _actor(_one_user(actor, old_user))
    where = _where(**filters)
    saved = _run(settings, None, lambda c: c.save_task_filter(name, user=owner, mode=mode, where=where, scope=scope))
    emit(_saved_json(saved), output, lambda: f"saved task filter {_saved_line(saved)}")


@filters_group.command("list")
@_filter_owner_options
@output_option
@with_settings
def filters_list_command(settings: Settings, output: str, old_user: str | None, actor: str | None, scope: str) -> None:
    """The user's saved filters in the scope, by name."""
    owner = _actor(_one_user(actor, old_user))
    saved = _run(settings, None, lambda c: c.task_filters(user=owner, scope=scope))
    emit({"filters": [_saved_json(f) for f in saved]}, output,
         lambda: "\n".join(_saved_line(f) for f in saved) or f"{owner} has no saved task filters in scope {scope}")


@filters_group.command("delete")
@click.argument("name", type=TEXT)
@_filter_owner_options
@output_option
@with_settings
def filters_delete_command(settings: Settings, output: str, name: str, old_user: str | None, actor: str | None,
                           scope: str) -> None:
    """Delete the saved filter NAME (an unknown name is an error)."""
    owner = _actor(_one_user(actor, old_user))
    if not _run(settings, None, lambda c: c.delete_task_filter(name, user=owner, scope=scope)):
        raise CliError(f"user {owner} has no saved task filter {name!r} in scope {scope}")
    emit({"deleted": name}, output, lambda: f"deleted task filter {name}")


commands = [tasks_group]
