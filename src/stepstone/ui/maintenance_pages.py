"""The UI's maintenance page: the stuck report (dead letters, retrying and old commands), the probe
of what is in flight, and retention (its policies, a form that sets one, a dry run, a sweep). It
calls the API's route functions, so the same roles and scope rules hold: the probe and retention
need a ``*`` grant, setting a policy or a sweep the admin role in every scope."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.datastructures import FormData
from starlette.responses import Response

from stepstone.api.auth import ALL_SCOPES, Principal
from stepstone.api.routes import operator_queries, retention
from stepstone.errors import InvalidInput
from stepstone.ops.retention import STATUS_CLASSES
from stepstone.ui.render import UI_PREFIX, page, query_of
from stepstone.ui.session import posted_form, signed_in

__all__ = ["router"]

router = APIRouter(prefix=UI_PREFIX, include_in_schema=False)
STUCK_AFTER = 900.0
"""A command open longer than this (15 minutes) shows as old in the stuck report."""


async def _page(request: Request, who: Principal, sweep: dict[str, Any] | None,
                policy_set: dict[str, Any] | None = None) -> Response:
    everywhere = who.can("viewer", ALL_SCOPES)
    return page(
        request, "maintenance.html", who, nav="maintenance",
        stuck=await operator_queries.stuck(request, who, STUCK_AFTER),
        probe=await operator_queries.probe(request, who, None) if everywhere else None,
        policies=await retention.list_policies(request, who) if everywhere else None,
        sweep=sweep, policy_set=policy_set,
        status_classes=STATUS_CLASSES)


@router.get("/maintenance")
async def maintenance_page(request: Request) -> Response:
    who = await signed_in(request)
    query_of(request)
    return await _page(request, who, None)


@router.post("/maintenance/retention")
async def retention_sweep(request: Request) -> Response:
    who = await signed_in(request)
    form = await posted_form(request, who)
    report = await retention.run_sweep(request, who, retention.Sweep(dry_run=form.get("dry_run") == "1"))
    return await _page(request, who, report)


def _days(form: FormData, name: str, label: str) -> float | None:
    """A window in days as seconds; blank (or 'never') is None."""
    text = str(form.get(name) or "").strip().lower()
    if text in ("", "never"):
        return None
    try:
        return float(text) * 86400
    except ValueError:
        raise InvalidInput(f"{label} takes a number of days, or blank; got {text[:40]!r}", what=name) from None


@router.post("/maintenance/retention/policy")
async def set_retention_policy(request: Request) -> Response:
    """Set one window of a workflow (or of the '*' default) from the policy form."""
    who = await signed_in(request)
    form = await posted_form(request, who)
    try:
        body = retention.Policy.model_validate({
            # The name as typed (blank: the '*' default): 'job ' is refused as the API refuses it, not trimmed.
            "workflow": str(form.get("workflow") or "") or "*", "status_class": form.get("status_class"),
            "retain_for_seconds": _days(form, "retain_days", "Archive after"),
            "purge_after_seconds": _days(form, "purge_days", "Purge after")})
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"]) or "policy"
        raise InvalidInput(f"{where}: {error['msg']}", what=where) from None
    row = await retention.set_policy(request, who, body)
    return await _page(request, who, None, row)
