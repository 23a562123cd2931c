"""The human task operations behind the API's and the UI's routes: authorize, then call the client.

A task is seen through its instance's scope: a task of a scope the caller cannot see is TaskNotFound,
exactly like a missing one. Working on a task (claim, complete, delegate...) takes the task_worker
role in its scope; the client then checks that the caller is the assignee, the owner or a candidate
(`TaskNotPermitted`, HTTP 403). `admin=True` overrides that check, takes the admin role, and is
recorded in the task's history. Task operations act as the principal's `task_user` with its groups.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from stepstone.api.auth import Principal
from stepstone.api.context import ApiContext, require
from stepstone.client import Client
from stepstone.client_tasks import TaskFilter, TaskInfo, decode_task_cursor
from stepstone.errors import TaskNotFound, TaskRefused

__all__ = ["claim", "complete", "count", "delegate", "inbox", "reassign", "resolve", "task", "unclaim"]

async def _shown(ctx: ApiContext, tasks: list[tuple[TaskInfo, str]]) -> list[dict[str, Any]]:
    """The tasks as every view shows them: the state fields they show and their completions' payloads
    redacted by their instances' registrations (docs/operations.md, Redaction)."""
    # A shallow copy: the response encodes it at once, and asdict's deep copy of every task's form and data
    # was three quarters of an inbox page's time (16 ms a page of 50 on a slow day; docs/api.md, "Measured").
    return await ctx.management.shown_tasks([{**vars(info), "scope": scope} for info, scope in tasks])


async def _plain(ctx: ApiContext, info: TaskInfo, scope: str) -> dict[str, Any]:
    return (await _shown(ctx, [(info, scope)]))[0]


async def _visible(ctx: ApiContext, who: Principal, task_id: str) -> tuple[TaskInfo, str]:
    info = await ctx.client(who.actor).task(task_id)
    scope = await ctx.management.instance_scope(info.instance_id)
    if scope is None or not who.sees(scope):
        raise TaskNotFound(task_id)
    return info, scope


async def task(ctx: ApiContext, who: Principal, task_id: str) -> dict[str, Any]:
    info, scope = await _visible(ctx, who, task_id)
    return await _plain(ctx, info, scope)


def _arguments(who: Principal, mode: str) -> dict[str, Any]:
    """The inbox is the caller's own: its user and groups (mode `all` lists every open task)."""
    return {"user": None if mode == "all" else who.task_user, "groups": () if mode == "all" else who.groups,
            "mode": mode}


def _within(who: Principal, where: TaskFilter) -> TaskFilter:
    """The filter narrowed to the scopes the caller sees: the inbox query filters by them, so pages and
    counts are exact whatever the caller's grants."""
    scopes = who.visible_scopes()
    return where if scopes is None else replace(where, scopes=tuple(scopes))


async def inbox(
    ctx: ApiContext, who: Principal, *, mode: str, where: TaskFilter, cursor: str | None, limit: int,
) -> dict[str, Any]:
    """A page of open tasks in inbox order (priority, then oldest), of the scopes the caller sees."""
    decode_task_cursor(cursor, what="cursor")  # refused naming the query parameter, not the client's `after`
    found = await ctx.client(who.actor).tasks(**_arguments(who, mode), where=_within(who, where), after=cursor,
                                              limit=limit)
    return {"items": await _shown(ctx, [(t, t.scope or "") for t in found.tasks]), "next_cursor": found.next_cursor}


async def count(ctx: ApiContext, who: Principal, *, mode: str, where: TaskFilter) -> dict[str, Any]:
    """``{"count", "more_than_cap", "cap"}``: the exact count of the caller's open tasks in the scopes it
    sees (`more_than_cap` is always false and `cap` null: kept for the callers that read them)."""
    n = await ctx.client(who.actor).count_tasks(**_arguments(who, mode), where=_within(who, where))
    return {"count": n, "more_than_cap": False, "cap": None}


async def _work(
    ctx: ApiContext, who: Principal, task_id: str, admin: bool,
    act: Callable[[Client], Awaitable[Any]],
) -> tuple[Any, str]:
    """Check the caller may work on the task (task_worker; admin for an override), then `act`. A refusal
    that carries the task's recorded completion (TaskNotOpen: the one that won) shows it as the task's
    views do, its payload redacted, since the error's body is one more view of the task."""
    info, scope = await _visible(ctx, who, task_id)
    require(who, "admin" if admin else "task_worker", scope)
    try:
        return await act(ctx.client(who.actor)), scope
    except TaskRefused as refused:
        if refused.completion is not None:
            refused.completion = (await _plain(ctx, replace(info, completion=refused.completion), scope))["completion"]
        raise


async def claim(ctx: ApiContext, who: Principal, task_id: str, *, admin: bool) -> dict[str, Any]:
    info, scope = await _work(ctx, who, task_id, admin, lambda c: c.claim_task(
        task_id, actor=who.task_user, groups=who.groups, admin=admin))
    return await _plain(ctx, info, scope)


async def unclaim(ctx: ApiContext, who: Principal, task_id: str, *, admin: bool) -> dict[str, Any]:
    info, scope = await _work(ctx, who, task_id, admin, lambda c: c.unclaim_task(
        task_id, actor=who.task_user, groups=who.groups, admin=admin))
    return await _plain(ctx, info, scope)


async def reassign(ctx: ApiContext, who: Principal, task_id: str, to: str, *, reason: str,
                   idempotency_key: str | None, admin: bool) -> dict[str, Any]:
    info, scope = await _work(ctx, who, task_id, admin, lambda c: c.reassign_task(
        task_id, to, actor=who.task_user, reason=reason, idempotency_key=idempotency_key, admin=admin))
    return await _plain(ctx, info, scope)


async def delegate(ctx: ApiContext, who: Principal, task_id: str, to: str, *, reason: str,
                   idempotency_key: str | None, admin: bool) -> dict[str, Any]:
    info, scope = await _work(ctx, who, task_id, admin, lambda c: c.delegate_task(
        task_id, to, actor=who.task_user, reason=reason, idempotency_key=idempotency_key, admin=admin))
    return await _plain(ctx, info, scope)


async def resolve(ctx: ApiContext, who: Principal, task_id: str, *, admin: bool) -> dict[str, Any]:
    info, scope = await _work(ctx, who, task_id, admin, lambda c: c.resolve_task(
        task_id, actor=who.task_user, admin=admin))
    return await _plain(ctx, info, scope)


async def complete(
    ctx: ApiContext, who: Principal, task_id: str, decision: str, payload: Any, *,
    idempotency_key: str | None, reviewed_version: int | None, admin: bool,
) -> dict[str, Any]:
    """Reserve the task's completion; a worker then moves the instance (`command_id` is its command)."""
    done, scope = await _work(ctx, who, task_id, admin, lambda c: c.complete_task(
        task_id, decision, payload, actor=who.task_user, groups=who.groups, idempotency_key=idempotency_key,
        reviewed_version=reviewed_version, admin=admin))
    return {"task": await _plain(ctx, done.task, scope), "command_id": done.command_id, "duplicate": done.duplicate}

