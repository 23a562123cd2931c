"""The UI's instance repairs: replay from a step, migrate to another version (with a dry run first).
Thin over `stepstone.api.routes.instance_actions`, the functions the API's routes call."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from stepstone.api import operations as ops
from stepstone.api.auth import Principal
from stepstone.api.context import context_of
from stepstone.api.routes.instance_actions import migrate, replay
from stepstone.core.limits import MAX_INT4
from stepstone.ui.render import UI_PREFIX, page, query_of
from stepstone.ui.session import back, form_number, posted_form, signed_in

__all__ = ["router"]

router = APIRouter(prefix=UI_PREFIX, include_in_schema=False)


async def _reached(request: Request, instance_id: str) -> list[str]:
    """The steps the instance reached, in the order it first reached them (the replay's choices)."""
    rows = await context_of(request).management.history_page(instance_id, after=0, limit=1000, failed_only=False)
    return list(dict.fromkeys(str(r["step"]) for r in rows if r.get("step") and r["step"] != "$end"))


async def _repair_page(request: Request, who: Principal, instance_id: str, **values: Any) -> Response:
    ctx = context_of(request)
    info = await ops.instance(ctx, who, instance_id)
    versions = sorted(w.version for w in ctx.registry if w.id == info["definition_id"]
                      and w.version != info["version"])
    return page(request, "repair.html", who, nav="instances", i=info, steps=await _reached(request, instance_id),
                versions=versions,
                **{"outcome": None, "error": None, **values})


@router.get("/instances/{instance_id}/repair")
async def repair_page(request: Request, instance_id: str) -> Response:
    who = await signed_in(request)
    query_of(request)
    return await _repair_page(request, who, instance_id)


@router.post("/instances/{instance_id}/replay")
async def replay_step(request: Request, instance_id: str) -> Response:
    who = await signed_in(request)
    form = await posted_form(request, who)
    step = str(form.get("step", ""))
    await replay(context_of(request), who, instance_id, step)
    return back(request, f"/instances/{instance_id}", f"replaying+from+{step}")


@router.post("/instances/{instance_id}/migrate")
async def migrate_version(request: Request, instance_id: str) -> Response:
    who = await signed_in(request)
    form = await posted_form(request, who)
    version = form_number(form.get("version"), MAX_INT4)
    if version is None:
        return await _repair_page(request, who, instance_id, error="Choose a version to migrate to.")
    dry_run = form.get("dry_run") == "1"
    outcome = await migrate(context_of(request), who, instance_id, version, step_map={}, dry_run=dry_run)
    if dry_run or outcome["outcome"] != "migrated":
        return await _repair_page(request, who, instance_id, outcome=outcome)
    return back(request, f"/instances/{instance_id}", f"migrated+to+v{version}")
