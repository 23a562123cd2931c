"""The human task operations behind the API's and the UI's routes: authorize, then call the client.

A task is seen through its instance's scope: a task of a scope the caller cannot see is TaskNotFound,
exactly like a missing one. Working on a task (claim, complete, delegate...) takes the task_worker
role in its scope; the client then checks that the caller is the assignee, the owner or a candidate
(`TaskNotPermitted`, HTTP 403). `admin=True` overrides that check, takes the admin role, and is
recorded in the task's history. Task operations act as the principal's `task_user` with its groups.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from typing import Any

from stepstone.api.auth import Principal
from stepstone.api.context import ApiContext, require
from stepstone.client import Client
from stepstone.client_tasks import TaskFilter, TaskInfo, TaskPage
from stepstone.errors import TaskNotFound

__all__ = ["COUNT_CAP", "claim", "complete", "count", "delegate", "inbox", "reassign", "resolve", "task", "unclaim"]

COUNT_CAP = 10_000
"""A caller limited to some scopes has its tasks counted up to here (`more_than_cap` beyond)."""
_SCAN_PAGES = 20
"""A page for a caller limited to some scopes skips other scopes' tasks for at most this many reads;
the page may then hold fewer tasks than asked, with a cursor to go on."""


def _plain(info: TaskInfo, scope: str) -> dict[str, Any]:
    return {**asdict(info), "scope": scope}


async def _visible(ctx: ApiContext, who: Principal, task_id: str) -> tuple[TaskInfo, str]:
    info = await ctx.client(who.actor).task(task_id)
    scope = await ctx.management.instance_scope(info.instance_id)
    if scope is None or not who.sees(scope):
        raise TaskNotFound(task_id)
    return info, scope


async def task(ctx: ApiContext, who: Principal, task_id: str) -> dict[str, Any]:
    info, scope = await _visible(ctx, who, task_id)
    return _plain(info, scope)


def _arguments(who: Principal, mode: str) -> dict[str, Any]:
    """The inbox is the caller's own: its user and groups (mode `all` lists every open task)."""
    return {"user": None if mode == "all" else who.task_user, "groups": () if mode == "all" else who.groups,
            "mode": mode}


def _in_one_scope(who: Principal, where: TaskFilter) -> TaskFilter | None:
    """The filter with the caller's scope in it when the caller sees exactly one scope (the inbox
    query filters by it, keyset pages and counts stay exact); None otherwise (every scope, or several:
    those are filtered after the query)."""
    scopes = who.visible_scopes()
    if scopes is None or len(scopes) != 1 or where.scope not in (None, scopes[0]):
        return None
    return replace(where, scope=scopes[0])


async def inbox(
    ctx: ApiContext, who: Principal, *, mode: str, where: TaskFilter, cursor: str | None, limit: int,
) -> dict[str, Any]:
    """A page of open tasks in inbox order (priority, then oldest), of the scopes the caller sees."""
    client = ctx.client(who.actor)
    scoped = _in_one_scope(who, where)
    if scoped is not None:
        found = await client.tasks(**_arguments(who, mode), where=scoped, after=cursor, limit=limit)
        return {"items": [_plain(t, scoped.scope or "") for t in found.tasks], "next_cursor": found.next_cursor}

    async def fetch(after: str | None, n: int) -> TaskPage:
        return await client.tasks(**_arguments(who, mode), where=where, after=after, limit=n)

    if who.visible_scopes() is None:
        found = await fetch(cursor, limit)
        scopes = await ctx.management.instance_scopes([t.instance_id for t in found.tasks])
        return {"items": [_plain(t, scopes.get(t.instance_id, "")) for t in found.tasks],
                "next_cursor": found.next_cursor}
    items: list[dict[str, Any]] = []
    after = cursor
    for _ in range(_SCAN_PAGES):
        # Asking for exactly what is missing keeps the page's cursor right after the last task read.
        found = await fetch(after, limit - len(items))
        items += await _in_scopes(ctx, who, found)
        after = found.next_cursor
        if after is None or len(items) == limit:
            break
    return {"items": items, "next_cursor": after}


async def _in_scopes(ctx: ApiContext, who: Principal, found: TaskPage) -> list[dict[str, Any]]:
    scopes = await ctx.management.instance_scopes([t.instance_id for t in found.tasks])
    return [_plain(t, scopes[t.instance_id]) for t in found.tasks
            if t.instance_id in scopes and who.sees(scopes[t.instance_id])]


async def count(ctx: ApiContext, who: Principal, *, mode: str, where: TaskFilter) -> dict[str, Any]:
    """``{"count", "more_than_cap", "cap"}``: exact for a caller who sees every scope; for one limited
    to some scopes, their tasks counted up to COUNT_CAP."""
    client = ctx.client(who.actor)
    scoped = _in_one_scope(who, where)
    if who.visible_scopes() is None or scoped is not None:
        n = await client.count_tasks(**_arguments(who, mode), where=scoped or where)
        return {"count": n, "more_than_cap": False, "cap": None}
    n, after = 0, None
    while n <= COUNT_CAP:
        found = await client.tasks(**_arguments(who, mode), where=where, after=after, limit=1000)
        n += len(await _in_scopes(ctx, who, found))
        after = found.next_cursor
        if after is None:
            break
    return {"count": min(n, COUNT_CAP), "more_than_cap": n > COUNT_CAP, "cap": COUNT_CAP}


async def _work(
    ctx: ApiContext, who: Principal, task_id: str, admin: bool,
    act: Callable[[Client], Awaitable[Any]],
) -> tuple[Any, str]:
    """Check the caller may work on the task (task_worker; admin for an override), then `act`."""
    _, scope = await _visible(ctx, who, task_id)
    require(who, "admin" if admin else "task_worker", scope)
    return await act(ctx.client(who.actor)), scope


async def claim(ctx: ApiContext, who: Principal, task_id: str, *, admin: bool) -> dict[str, Any]:
    info, scope = await _work(ctx, who, task_id, admin, lambda c: c.claim_task(
        task_id, actor=who.task_user, groups=who.groups, admin=admin))
    return _plain(info, scope)


async def unclaim(ctx: ApiContext, who: Principal, task_id: str, *, admin: bool) -> dict[str, Any]:
    info, scope = await _work(ctx, who, task_id, admin, lambda c: c.unclaim_task(
        task_id, actor=who.task_user, admin=admin))
    return _plain(info, scope)


async def reassign(ctx: ApiContext, who: Principal, task_id: str, to: str, *, reason: str,
                   idempotency_key: str | None, admin: bool) -> dict[str, Any]:
    info, scope = await _work(ctx, who, task_id, admin, lambda c: c.reassign_task(
        task_id, to, actor=who.task_user, reason=reason, idempotency_key=idempotency_key, admin=admin))
    return _plain(info, scope)


async def delegate(ctx: ApiContext, who: Principal, task_id: str, to: str, *, reason: str,
                   idempotency_key: str | None, admin: bool) -> dict[str, Any]:
    info, scope = await _work(ctx, who, task_id, admin, lambda c: c.delegate_task(
        task_id, to, actor=who.task_user, reason=reason, idempotency_key=idempotency_key, admin=admin))
    return _plain(info, scope)


async def resolve(ctx: ApiContext, who: Principal, task_id: str, *, admin: bool) -> dict[str, Any]:
    info, scope = await _work(ctx, who, task_id, admin, lambda c: c.resolve_task(
        task_id, actor=who.task_user, admin=admin))
    return _plain(info, scope)


async def complete(
    ctx: ApiContext, who: Principal, task_id: str, decision: str, payload: Any, *,
    idempotency_key: str | None, reviewed_version: int | None, admin: bool,
) -> dict[str, Any]:
    """Reserve the task's completion; a worker then moves the instance (`command_id` is its command)."""
    done, scope = await _work(ctx, who, task_id, admin, lambda c: c.complete_task(
        task_id, decision, payload, actor=who.task_user, groups=who.groups, idempotency_key=idempotency_key,
        reviewed_version=reviewed_version, admin=admin))
    return {"task": _plain(done.task, scope), "command_id": done.command_id, "duplicate": done.duplicate}

