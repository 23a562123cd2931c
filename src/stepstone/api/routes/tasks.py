"""Human tasks: the caller's inbox (its tasks, its groups' tasks), count, show, claim, unclaim,
complete with a decision and its payload, reassign, delegate, resolve."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import Field

from stepstone.api import task_operations as tasks
from stepstone.api.bodies import Body
from stepstone.api.context import Caller, Writer, context_of
from stepstone.api.pagination import DEFAULT_LIMIT, MAX_LIMIT
from stepstone.client_tasks import TaskFilter
from stepstone.core.limits import MAX_INT4

__all__ = ["router"]

router = APIRouter(prefix="/tasks", tags=["tasks"])
Text = Annotated[str | None, Query(max_length=500)]
Mode = Literal["inbox", "assigned", "candidate", "all"]
_MODE = Query(description="inbox: mine and unassigned ones offered to me or my groups; assigned: mine; "
                          "candidate: unassigned ones offered to me or my groups; all: every open task.")


class Override(Body):
    admin: bool = Field(default=False, description="Override the assignee and candidate checks (admin role; "
                                                   "recorded in the task's history).")


class Completion(Override):
    decision: str = Field(max_length=500)
    payload: Any = Field(default=None, description="The decision's payload (see the task's `form`).")
    idempotency_key: str | None = Field(default=None, max_length=500)
    reviewed_version: int | None = Field(default=None, ge=0, le=2**62,
                                         description="The `state_version` the completer reviewed.")


class Handover(Override):
    to: str = Field(max_length=500, description="The user who gets the task.")
    reason: str = Field(default="", max_length=10_000)
    idempotency_key: str | None = Field(default=None, max_length=500)


Priority = Annotated[int | None, Query(ge=-MAX_INT4 - 1, le=MAX_INT4)]


def _where(
    workflow: Text = None, priority_at_least: Priority = None, due_before: datetime | None = None,
    candidate_group: Text = None, text: Text = None,
    follow_up_before: Annotated[datetime | None, Query(
        description="Only tasks without a follow-up date or with one at or before this instant.")] = None,
    hide_later_follow_ups: Annotated[bool, Query(
        description="Leave out the tasks put aside until a follow-up date still to come (the database's now).",
    )] = False,
) -> TaskFilter:
    """The inbox's filters, the same query parameters for a page and its count."""
    return TaskFilter(workflow=workflow, priority_at_least=priority_at_least, due_before=due_before,
                      candidate_group=candidate_group, text=text, follow_up_before=follow_up_before,
                      hide_later_follow_ups=hide_later_follow_ups)


Where = Annotated[TaskFilter, Depends(_where)]


@router.get("", summary="Open tasks in inbox order (priority, then oldest)")
async def list_tasks(
    request: Request, who: Caller, where: Where, mode: Annotated[Mode, _MODE] = "inbox",
    cursor: Annotated[str | None, Query(max_length=1000)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = DEFAULT_LIMIT,
) -> dict[str, Any]:
    return await tasks.inbox(context_of(request), who, mode=mode, cursor=cursor, limit=limit, where=where)


@router.get("/count", summary="How many open tasks the same query lists")
async def count_tasks(request: Request, who: Caller, where: Where,
                      mode: Annotated[Mode, _MODE] = "inbox") -> dict[str, Any]:
    return await tasks.count(context_of(request), who, mode=mode, where=where)


@router.get("/{task_id}", summary="A task: who holds it, its decisions and their form, what it shows")
async def get_task(request: Request, who: Caller, task_id: str) -> dict[str, Any]:
    return await tasks.task(context_of(request), who, task_id)


@router.post("/{task_id}/claim", summary="Take an unassigned task")
async def claim_task(request: Request, who: Writer, task_id: str, body: Override | None = None) -> dict[str, Any]:
    return await tasks.claim(context_of(request), who, task_id, admin=bool(body and body.admin))


@router.post("/{task_id}/unclaim", summary="Give a task back to its candidates")
async def unclaim_task(request: Request, who: Writer, task_id: str, body: Override | None = None) -> dict[str, Any]:
    return await tasks.unclaim(context_of(request), who, task_id, admin=bool(body and body.admin))


@router.post("/{task_id}/complete", status_code=202,
             summary="Complete a task with a decision (only its assignee, owner or a candidate, or an admin)")
async def complete_task(request: Request, who: Writer, task_id: str, body: Completion) -> dict[str, Any]:
    return await tasks.complete(context_of(request), who, task_id, body.decision, body.payload,
                                idempotency_key=body.idempotency_key, reviewed_version=body.reviewed_version,
                                admin=body.admin)


@router.post("/{task_id}/reassign", summary="Give a task to another user")
async def reassign_task(request: Request, who: Writer, task_id: str, body: Handover) -> dict[str, Any]:
    return await tasks.reassign(context_of(request), who, task_id, body.to, reason=body.reason,
                                idempotency_key=body.idempotency_key, admin=body.admin)


@router.post("/{task_id}/delegate", summary="Delegate a task (the delegate resolves it back)")
async def delegate_task(request: Request, who: Writer, task_id: str, body: Handover) -> dict[str, Any]:
    return await tasks.delegate(context_of(request), who, task_id, body.to, reason=body.reason,
                                idempotency_key=body.idempotency_key, admin=body.admin)


@router.post("/{task_id}/resolve", summary="Hand a delegated task back to its owner")
async def resolve_task(request: Request, who: Writer, task_id: str, body: Override | None = None) -> dict[str, Any]:
    return await tasks.resolve(context_of(request), who, task_id, admin=bool(body and body.admin))
