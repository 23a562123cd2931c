"""The UI's task inbox: my tasks and my groups' tasks, a task with its completion form generated from
the decisions' schema, claim, unclaim, complete, delegate, resolve, reassign. Thin over
`stepstone.api.task_operations`, the same functions the API calls."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from stepstone.api import task_operations as tasks
from stepstone.api.auth import Principal
from stepstone.api.context import context_of
from stepstone.client_tasks import TaskFilter
from stepstone.errors import InvalidInput
from stepstone.ui.render import UI_PREFIX, page, query_of
from stepstone.ui.session import back, posted_form, signed_in
from stepstone.ui.task_form import decisions_of, payload_of

__all__ = ["router"]

router = APIRouter(prefix=UI_PREFIX, include_in_schema=False)
MODES = {"inbox": "My inbox", "assigned": "Assigned to me", "candidate": "Offered to me or my groups",
         "all": "Every open task"}


@router.get("/tasks")
async def inbox_page(request: Request) -> Response:
    who = await signed_in(request)
    ctx = context_of(request)
    q = query_of(request, "mode", "text", "workflow", "cursor")
    mode = q.get("mode") if q.get("mode") in MODES else "inbox"
    where = TaskFilter(text=q.get("text") or None, workflow=q.get("workflow") or None)
    listing = await tasks.inbox(ctx, who, mode=str(mode), where=where, cursor=q.get("cursor") or None, limit=50)
    counted = await tasks.count(ctx, who, mode=str(mode), where=where)
    total = f"{counted['count']:,}+" if counted["more_than_cap"] else f"{counted['count']:,}"
    return page(request, "tasks.html", who, nav="tasks", items=listing["items"], next_cursor=listing["next_cursor"],
                modes=MODES, mode=mode, total=total, text=q.get("text") or "", workflow=q.get("workflow") or "",
                me=who.task_user)


async def _task_page(request: Request, who: Principal, task_id: str, *, error: str | None = None,
                     chosen: str = "", posted: dict[str, str] | None = None) -> Response:
    found = await tasks.task(context_of(request), who, task_id)
    return page(request, "task.html", who, nav="tasks", t=found, decisions=decisions_of(found["form"]),
                is_open=found["status"] == "OPEN", me=who.task_user, error=error,
                chosen=chosen, posted=posted or {}, status_code=422 if error else 200)


@router.get("/tasks/{task_id}")
async def task_page(request: Request, task_id: str) -> Response:
    who = await signed_in(request)
    query_of(request)
    return await _task_page(request, who, task_id)


@router.post("/tasks/{task_id}/complete")
async def complete(request: Request, task_id: str) -> Response:
    who = await signed_in(request)
    form = await posted_form(request, who)
    ctx = context_of(request)
    found = await tasks.task(ctx, who, task_id)
    name = str(form.get("decision", ""))
    posted = {k: str(v) for k, v in form.items() if k != "csrf"}
    decision = next((d for d in decisions_of(found["form"]) if d.name == name), None)
    if decision is None:
        return await _task_page(request, who, task_id, error=f"This task has no decision {name!r}.")
    try:
        await tasks.complete(ctx, who, task_id, name, payload_of(decision, posted), idempotency_key=None,
                             reviewed_version=None, admin=False)
    except InvalidInput as exc:
        return await _task_page(request, who, task_id, error=str(exc).splitlines()[0], chosen=name, posted=posted)
    return back(request, "/tasks", f"completed+{_short(found)}+with+{name}")


def _short(found: dict[str, Any]) -> str:
    return str(found["id"])[:8]


@router.post("/tasks/{task_id}/{action}")
async def act(request: Request, task_id: str, action: str) -> Response:
    """claim, unclaim, resolve, delegate (to), reassign (to)."""
    who = await signed_in(request)
    form = await posted_form(request, who)
    ctx = context_of(request)
    # The name as typed: one with spaces around it is refused by the name check, as the API and the CLI
    # refuse it, rather than quietly becoming another user's name.
    to, reason = str(form.get("to", "")), str(form.get("reason", ""))
    if action in ("claim", "unclaim", "resolve"):
        done = await getattr(tasks, action)(ctx, who, task_id, admin=False)
    elif action in ("delegate", "reassign"):
        if not to:
            return await _task_page(request, who, task_id, error=f"Name the user to {action} the task to.")
        try:
            done = await getattr(tasks, action)(ctx, who, task_id, to, reason=reason, idempotency_key=None,
                                                admin=False)
        except InvalidInput as exc:
            return await _task_page(request, who, task_id, error=str(exc).splitlines()[0])
    else:
        raise InvalidInput(f"no task action {action!r}", what="action")
    flash = f"{action}ed" if not action.endswith("e") else f"{action}d"
    return back(request, f"/tasks/{task_id}", f"{flash}+{_short(done)}")
