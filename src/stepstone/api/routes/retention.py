"""Retention: the policies (how long instances of each status class are kept before they are archived,
then purged) and a sweep, with a dry run that counts. Policies span every scope, so reading them
takes a ``*`` grant and changing them or running a sweep the admin role in every scope."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import Field

from stepstone.api.auth import ALL_SCOPES
from stepstone.api.bodies import Body
from stepstone.api.context import Caller, Writer, context_of, require
from stepstone.ops import Operations

__all__ = ["router"]

router = APIRouter(prefix="/retention", tags=["retention"])
Seconds = float | None
_YEARS = 100 * 365 * 86400


class Policy(Body):
    workflow: str = Field(default="*", max_length=500, description="A workflow, or '*' for the default.")
    status_class: Literal["completed", "failed", "waiting", "outbox_published"]
    retain_for_seconds: Seconds = Field(default=None, ge=0, le=_YEARS,
                                        description="Archive after this long (null: never on a timer).")
    purge_after_seconds: Seconds = Field(default=None, ge=0, le=_YEARS,
                                         description="Delete this long after archiving (null: keep the "
                                                     "policy's current purge window; 1 day for a new one).")


class Sweep(Body):
    # Required: a sweep deletes, so an empty body (or none) is refused (422) rather than taken for a real one.
    dry_run: bool = Field(description="true: count what the sweep would archive and purge; false: sweep. "
                                      "Required, so that no empty request deletes anything.")
    workflow: str | None = Field(default=None, max_length=500, description="Only instances of this workflow.")
    scope: str | None = Field(default=None, max_length=500, description="Only instances of this scope.")


def _delta(seconds: float | None) -> timedelta | None:
    return None if seconds is None else timedelta(seconds=seconds)


@router.get("/policies", summary="Every retention policy")
async def list_policies(request: Request, who: Caller) -> list[dict[str, Any]]:
    require(who, "viewer", ALL_SCOPES)
    return await Operations.on(context_of(request).store).retention_policies()


@router.put("/policies", summary="Set one retention window of a workflow (or of the '*' default)")
async def set_policy(request: Request, who: Writer, body: Policy) -> dict[str, Any]:
    require(who, "admin", ALL_SCOPES)
    return await Operations.on(context_of(request).store, actor=who.actor).set_retention_policy(
        body.workflow, body.status_class, _delta(body.retain_for_seconds), _delta(body.purge_after_seconds))


@router.post("/run", summary="Run one retention sweep now (archive, purge, old published outbox rows)")
async def run_sweep(request: Request, who: Writer, body: Sweep) -> dict[str, Any]:
    require(who, "admin", ALL_SCOPES)
    report = await Operations.on(context_of(request).store, actor=who.actor).retention_run(
        dry_run=body.dry_run, workflow=body.workflow, scope=body.scope)
    return report.as_dict()
