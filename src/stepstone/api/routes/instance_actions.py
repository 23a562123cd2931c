"""Instance repairs that need the operator's tools: replay from a step, migrate to another version.

Both take the operator role in the instance's scope; an instance of another scope is not found.
A migration's target is a version of the instance's workflow that this server's --app knows.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from stepstone.api.auth import Principal
from stepstone.api.bodies import Body
from stepstone.api.context import ApiContext, Writer, context_of, require, visible_instance
from stepstone.core.limits import MAX_INT4
from stepstone.errors import DefinitionNotFound
from stepstone.ops import Operations

__all__ = ["migrate", "replay", "router"]

router = APIRouter(prefix="/instances", tags=["instances"])


class ReplayRequest(Body):
    step: str = Field(max_length=500, description="A step the instance reached (its latest visit runs again).")


class MigrateRequest(Body):
    to_version: int = Field(ge=1, le=MAX_INT4, description="A version of the instance's workflow.")
    step_map: dict[str, str] = Field(default_factory=dict, max_length=1000,
                                     description="Old step -> new step, for steps the target renamed.")
    dry_run: bool = Field(default=False, description="Check the instance against the target; change nothing.")


async def replay(ctx: ApiContext, who: Principal, instance_id: str, step: str) -> dict[str, Any]:
    require(who, "operator", await visible_instance(ctx, who, instance_id))
    return (await Operations.on(ctx.store, actor=who.actor).replay(instance_id, step)).as_dict()


async def migrate(ctx: ApiContext, who: Principal, instance_id: str, to_version: int, *,
                  step_map: dict[str, str], dry_run: bool) -> dict[str, Any]:
    require(who, "operator", await visible_instance(ctx, who, instance_id))
    client = ctx.client(who.actor)
    workflow = (await client.get(instance_id)).definition_id
    target = ctx.registry.find(workflow, to_version)
    if target is None:
        raise DefinitionNotFound(workflow, to_version)
    report = await client.migrate([instance_id], to=target, step_map=step_map, dry_run=dry_run)
    [outcome] = report.outcomes
    return {**asdict(outcome), "dry_run": dry_run, "to_version": to_version}


@router.post("/{instance_id}/replay", summary="Run a step again on the state the instance had when it reached it")
async def replay_instance(request: Request, who: Writer, instance_id: str, body: ReplayRequest) -> dict[str, Any]:
    return await replay(context_of(request), who, instance_id, body.step)


@router.post("/{instance_id}/migrate", summary="Move the instance to another version of its workflow")
async def migrate_instance(request: Request, who: Writer, instance_id: str, body: MigrateRequest) -> dict[str, Any]:
    return await migrate(context_of(request), who, instance_id, body.to_version, step_map=body.step_map,
                         dry_run=body.dry_run)
