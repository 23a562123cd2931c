"""The operator's queries: the execution probe (what is in flight, claimable, deferred, parked) and
the stuck report (dead letters, retrying commands, commands open too long).

The probe of one instance takes its scope's viewer role; the probe of everything takes a ``*``
grant (it counts commands of every scope). The stuck report lists only the visible scopes' items.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request

from stepstone.api.auth import ALL_SCOPES
from stepstone.api.context import Caller, context_of, require, visible_instance
from stepstone.core.timestamps import MAX_SECONDS
from stepstone.ops import InstanceFilter, Operations

__all__ = ["router"]

router = APIRouter(prefix="/operator", tags=["operator queries"])


@router.get("/probe", summary="What is in flight, claimable, deferred and parked (of one instance, or all)")
async def probe(
    request: Request, who: Caller,
    instance_id: Annotated[str | None, Query(max_length=100, description="Default: every instance.")] = None,
) -> dict[str, Any]:
    ctx = context_of(request)
    if instance_id is None:
        require(who, "viewer", ALL_SCOPES)
    else:
        await visible_instance(ctx, who, instance_id)
    return (await Operations.on(ctx.store).probe(instance_id)).as_dict()


@router.get("/stuck", summary="Dead letters, retrying commands and commands open for too long")
async def stuck(
    request: Request, who: Caller,
    older_than_seconds: Annotated[float, Query(ge=0, le=MAX_SECONDS, description=(
        "Commands open at least this long (0 to a thousand years, as `stepstone stuck --older-than`)."))] = 900.0,
) -> dict[str, Any]:
    operations = Operations.on(context_of(request).store)
    older_than = timedelta(seconds=older_than_seconds)
    scopes = who.visible_scopes()
    if scopes is None:
        return (await operations.stuck(older_than)).as_dict()
    # Read in each scope the caller sees: the report is capped (oldest instances first), so capping it over
    # every scope and filtering afterwards let another scope's many dead letters hide every one of these.
    reports = [(await operations.stuck(older_than, where=InstanceFilter(scope=scope))).as_dict() for scope in scopes]
    items = sorted((item for report in reports for item in report["items"]),
                   key=lambda i: (i["instance_id"], i["command_id"]))  # the report's own order
    return {"older_than_seconds": older_than.total_seconds(), "items": items,
            "more": any(report["more"] for report in reports)}
