"""The UI's maintenance page: the stuck report (dead letters, retrying and old commands), the probe
of what is in flight, and retention (its policies, a dry run, a sweep). It calls the API's route
functions, so the same roles and scope rules hold: the probe and retention need a ``*`` grant, a
sweep the admin role in every scope."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from stepstone.api.auth import ALL_SCOPES, Principal
from stepstone.api.routes import operator_queries, retention
from stepstone.ui.render import UI_PREFIX, page
from stepstone.ui.session import posted_form, signed_in

__all__ = ["router"]

router = APIRouter(prefix=UI_PREFIX, include_in_schema=False)
STUCK_AFTER = 900.0
"""A command open longer than this (15 minutes) shows as old in the stuck report."""


async def _page(request: Request, who: Principal, sweep: dict[str, Any] | None) -> Response:
    everywhere = who.can("viewer", ALL_SCOPES)
    return page(
        request, "maintenance.html", who, nav="maintenance",
        stuck=await operator_queries.stuck(request, who, STUCK_AFTER),
        probe=await operator_queries.probe(request, who, None) if everywhere else None,
        policies=await retention.list_policies(request, who) if everywhere else None,
        can_sweep=who.can("admin", ALL_SCOPES), sweep=sweep)


@router.get("/maintenance")
async def maintenance_page(request: Request) -> Response:
    return await _page(request, await signed_in(request), None)


@router.post("/maintenance/retention")
async def retention_sweep(request: Request) -> Response:
    who = await signed_in(request)
    form = await posted_form(request, who)
    report = await retention.run_sweep(request, who, retention.Sweep(dry_run=form.get("dry_run") == "1"))
    return await _page(request, who, report)
