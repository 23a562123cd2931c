"""Instances: list, counts, start, get, history, positions, children, commands, outbox events,
signal, cancel, retry."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, status
from pydantic import BeforeValidator, Field

from stepstone.api import operations as ops
from stepstone.api.bodies import Body
from stepstone.api.context import Caller, Writer, context_of
from stepstone.api.pagination import DEFAULT_LIMIT, MAX_LIMIT
from stepstone.core.timestamps import MAX_SECONDS

__all__ = ["router"]

router = APIRouter(prefix="/instances", tags=["instances"])
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description="Rows per page.")]
Cursor = Annotated[str | None, Query(max_length=1000, description="`next_cursor` of the previous page.")]
Text = Annotated[str | None, Query(max_length=500)]
Archived = Annotated[bool, Query(description="Include instances past their retention window (archived).")]
StatusName = Literal["PENDING", "RUNNING", "WAITING", "COMPLETED", "FAILED", "COMPENSATING", "COMPENSATED",
                     "CANCELLED", "TIMED_OUT", "COMPENSATION_FAILED"]


def _upper(value: object) -> object:
    return value.upper() if isinstance(value, str) else value


Status = Annotated[StatusName, BeforeValidator(_upper)]
"""An instance status in any case, as the CLI takes it (`failed` is FAILED)."""
CommandState = Literal["PENDING", "DEFERRED", "CLAIMED", "PARKED", "DEAD", "COMPLETE", "REJECTED", "STALE",
                       "FAILED", "SUPERSEDED", "CANCELLED"]


class StartRequest(Body):
    workflow: str = Field(max_length=500, description="A workflow of the server's --app (its latest version).")
    input: Any = Field(default=None, description="The instance's input (a JSON object for a state model).")
    scope: str | None = Field(default=None, max_length=500,
                              description="Default: the caller's only scope, else 'default'.")
    idempotency_key: str | None = Field(default=None, max_length=500)
    business_key: str | None = Field(default=None, max_length=500)
    deadline: float | None = Field(
        default=None, ge=0, le=MAX_SECONDS,
        description="Seconds from now (database clock) until the instance times out, compensating what it "
                    "completed; default: the workflow's own deadline.")


class SignalRequest(Body):
    name: str = Field(max_length=500)
    payload: Any = None
    dedup_key: str | None = Field(default=None, max_length=500)
    position: str = Field(default="", max_length=500, description="A branch's path; '' is the root.")


class CancelRequest(Body):
    reason: str = Field(default="", max_length=10_000)
    compensate: bool = Field(default=False, description="Compensate the completed steps first, then CANCELLED.")


@router.get("", summary="List instances, newest first")
async def list_instances(
    request: Request, who: Caller,
    status: Annotated[list[Status] | None, Query(description="Only these statuses (repeat it: `status=FAILED"
                                                             "&status=COMPENSATION_FAILED`).")] = None,
    workflow: Text = None, business_key: Text = None, scope: Text = None, cursor: Cursor = None,
    limit: Limit = DEFAULT_LIMIT, include_archived: Archived = False,
) -> dict[str, Any]:
    return await ops.instances(context_of(request), who, statuses=[str(s) for s in status or ()],
                               workflow=workflow, business_key=business_key, scope=scope, cursor=cursor,
                               limit=limit, include_archived=include_archived)


@router.get("/counts", summary="How many instances are in each status (each counted up to 10,000)")
async def instance_counts(request: Request, who: Caller, workflow: Text = None, business_key: Text = None,
                          scope: Text = None, include_archived: Archived = False) -> dict[str, Any]:
    return await ops.counts(context_of(request), who, workflow, include_archived, scope=scope,
                            business_key=business_key)


@router.post("", status_code=status.HTTP_201_CREATED, summary="Start an instance")
async def start_instance(request: Request, who: Writer, body: StartRequest) -> dict[str, Any]:
    return await ops.start(context_of(request), who, body.workflow, body.input, scope=body.scope,
                           idempotency_key=body.idempotency_key, business_key=body.business_key,
                           deadline=body.deadline)


@router.get("/{instance_id}", summary="An instance: status, state, positions, children, waits")
async def get_instance(request: Request, who: Caller, instance_id: str) -> dict[str, Any]:
    return await ops.instance(context_of(request), who, instance_id)


@router.get("/{instance_id}/history", summary="The instance's history, oldest first")
async def get_history(
    request: Request, who: Caller, instance_id: str, failed_only: bool = False, cursor: Cursor = None,
    limit: Limit = DEFAULT_LIMIT,
) -> dict[str, Any]:
    return await ops.history(context_of(request), who, instance_id, cursor=cursor, limit=limit,
                             failed_only=failed_only)


@router.get("/{instance_id}/positions", summary="The root position and every branch position")
async def get_positions(request: Request, who: Caller, instance_id: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = (await ops.instance(context_of(request), who, instance_id))["positions"]
    return found


@router.get("/{instance_id}/children", summary="Child instances this instance started")
async def get_children(request: Request, who: Caller, instance_id: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = (await ops.instance(context_of(request), who, instance_id))["children"]
    return found


@router.get("/{instance_id}/compensations",
            summary="The completed steps that declare a compensation, in order, and what became of each")
async def get_compensations(request: Request, who: Caller, instance_id: str) -> list[dict[str, Any]]:
    return await ops.compensations(context_of(request), who, instance_id)


@router.get("/{instance_id}/commands", summary="The instance's commands (pending, timers, parked, dead, done)")
async def get_commands(
    request: Request, who: Caller, instance_id: str,
    state: Annotated[list[CommandState] | None, Query(description="Only these states.")] = None,
    cursor: Cursor = None, limit: Limit = DEFAULT_LIMIT,
) -> dict[str, Any]:
    states = [str(s) for s in state] if state else None
    return await ops.commands(context_of(request), who, instance_id, states=states, cursor=cursor, limit=limit)


@router.get("/{instance_id}/outbox", summary="Events the instance staged, and whether they were published")
async def get_outbox(
    request: Request, who: Caller, instance_id: str, cursor: Cursor = None, limit: Limit = DEFAULT_LIMIT,
) -> dict[str, Any]:
    return await ops.outbox_events(context_of(request), who, instance_id, cursor=cursor, limit=limit)


@router.post("/{instance_id}/signals", status_code=status.HTTP_202_ACCEPTED, summary="Send a signal")
async def send_signal(request: Request, who: Writer, instance_id: str, body: SignalRequest) -> dict[str, Any]:
    return await ops.signal(context_of(request), who, instance_id, body.name, body.payload,
                            dedup_key=body.dedup_key, position=body.position)


@router.post("/{instance_id}/cancel", summary="Cancel the instance (repeating it is harmless)")
async def cancel_instance(
    request: Request, who: Writer, instance_id: str, body: CancelRequest | None = None,
) -> dict[str, Any]:
    return await ops.cancel(context_of(request), who, instance_id, body.reason if body else "",
                            compensate=body.compensate if body else False)


@router.post("/{instance_id}/retry", summary="Run the failed step of a FAILED instance again, or resume the "
                                           "compensation of a COMPENSATION_FAILED one where it stopped")
async def retry_instance(request: Request, who: Writer, instance_id: str) -> dict[str, Any]:
    return await ops.retry(context_of(request), who, instance_id)
