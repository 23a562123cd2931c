"""The UI's incidents page: failed instances, sagas whose compensation gave up and dead-lettered
commands, narrowed by a filter, with retry or migrate for one, a selection, or every failed instance
the filter matches. Each goes through a confirmation that says how many instances it acts on (a dry
run of the same bulk operation; for a migration, the check of each instance against the target), and
ends on a result per instance. Thin over `stepstone.api.bulk_operations` and
`stepstone.api.bulk_migration`, as the API's bulk routes are."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.datastructures import FormData
from starlette.responses import Response

from stepstone.api import operations as ops
from stepstone.api.auth import Principal
from stepstone.api.bulk_migration import bulk_migrate
from stepstone.api.bulk_operations import bulk
from stepstone.api.context import context_of
from stepstone.core.limits import MAX_INT4
from stepstone.core.model import COMPENSATION_FAILED
from stepstone.errors import InvalidInput
from stepstone.ops import InstanceFilter
from stepstone.ui.render import UI_PREFIX, page, query_of, ui_root
from stepstone.ui.session import back, form_number, posted_form, signed_in

__all__ = ["router"]

router = APIRouter(prefix=UI_PREFIX, include_in_schema=False)
FILTERS = ("workflow", "scope")
"""What the page narrows the failed instances by (and a retry of every match uses)."""


def _filters(values: Any) -> dict[str, str | None]:
    return {k: (str(values.get(k) or "").strip() or None) for k in FILTERS}


def _where(filters: dict[str, str | None]) -> InstanceFilter:
    return InstanceFilter(status=("FAILED",), workflow=filters["workflow"], scope=filters["scope"])


def _describe(filters: dict[str, str | None]) -> str:
    named = [f"{k} {v}" for k, v in filters.items() if v]
    return "every failed instance" + (f" of {' and '.join(named)}" if named else "")


async def _incidents(request: Request, who: Principal, filters: dict[str, str | None],
                     cursor: str | None) -> dict[str, Any]:
    ctx = context_of(request)
    failed = await ops.instances(ctx, who, statuses=["FAILED"], workflow=filters["workflow"], business_key=None,
                                 scope=filters["scope"], cursor=cursor, limit=100)
    # Sagas whose compensation gave up: a retry (one, a selection) resumes it where it stopped.
    gave_up = await ops.instances(ctx, who, statuses=[COMPENSATION_FAILED], workflow=filters["workflow"],
                                  business_key=None, scope=filters["scope"], cursor=None, limit=100)
    dead = await ops.dead_letters(ctx, who, cursor=None, limit=100, workflow=filters["workflow"],
                                  scope=filters["scope"])
    return {"items": failed["items"], "next_cursor": failed["next_cursor"], "gave_up": gave_up["items"],
            "gave_up_more": gave_up["next_cursor"] is not None, "dead": dead["items"], "filters": filters,
            "described": _describe(filters)}


@router.get("/dead-letters")
async def dead_letters_page(request: Request) -> Response:
    who = await signed_in(request)
    q = query_of(request, *FILTERS, "cursor")
    found = await _incidents(request, who, _filters(q), q.get("cursor") or None)
    return page(request, "dead_letters.html", who, nav="dead", live="list", report=None, **found)


def _chosen(form: FormData) -> list[str]:
    return sorted({str(v) for v in form.getlist("instance")})


@router.post("/dead-letters/confirm")
async def confirm_bulk_retry(request: Request) -> Response:
    """How many instances the retry acts on, before it does: the selection, or a dry run of the filter."""
    who = await signed_in(request)
    form = await posted_form(request, who)
    root = ui_root(request)
    common: dict[str, Any] = {"action": "retry", "target": f"{root}/dead-letters/retry", "back": f"{root}/dead-letters",
              "danger": False, "reason": False, "scope": None}
    if form.get("every") == "1":
        filters = _filters(form)
        counted = await bulk(context_of(request), who, "retry", where=_where(filters), dry_run=True)
        hidden = [("every", "1"), *((k, v) for k, v in filters.items() if v)]
        return page(request, "confirm.html", who, heading=f"Retry {counted['matched']} instance(s)?",
                    question=f"This retries {_describe(filters)}: {counted['matched']} now. Each gets its own "
                             "result.", items=[], confirm_label="Retry every match", hidden=hidden, **common)
    chosen = _chosen(form)
    if not chosen:
        return back(request, "/dead-letters", "nothing+selected")
    return page(request, "confirm.html", who, heading=f"Retry {len(chosen)} instance(s)?",
                question="The failed step of each runs again (or the compensation it gave up, where it stopped); "
                         "each gets its own result.", items=chosen,
                confirm_label="Retry all", hidden=[("instance", i) for i in chosen], **common)


@router.post("/dead-letters/retry")
async def bulk_retry(request: Request) -> Response:
    who = await signed_in(request)
    form = await posted_form(request, who)
    ctx = context_of(request)
    if form.get("every") == "1":
        report = await bulk(ctx, who, "retry", where=_where(_filters(form)))
    else:
        report = await bulk(ctx, who, "retry", ids=_chosen(form))
    return page(request, "dead_letters.html", who, nav="dead", report=report,
                **await _incidents(request, who, _filters({}), None))


@router.post("/dead-letters/migrate")
async def bulk_migrate_failed(request: Request) -> Response:
    """Check (dry run, with a button to go ahead) or migrate the selection or every match to a version."""
    who = await signed_in(request)
    form = await posted_form(request, who)
    version = form_number(form.get("version"), MAX_INT4)
    if version is None:
        raise InvalidInput("choose the version to migrate to (a whole number, 1 or more)", what="version")
    every = form.get("every") == "1"
    filters = _filters(form) if every else _filters({})
    chosen = [] if every else _chosen(form)
    if not every and not chosen:
        return back(request, "/dead-letters", "nothing+selected")
    dry_run = form.get("dry_run") != "0"
    report = await bulk_migrate(context_of(request), who, version, where=_where(filters) if every else None,
                                ids=None if every else chosen, dry_run=dry_run)
    hidden = [("every", "1"), *((k, v) for k, v in filters.items() if v)] if every else [
        ("instance", i) for i in chosen]
    return page(request, "dead_letters.html", who, nav="dead", report=report,
                go_ahead=[*hidden, ("version", str(version)), ("dry_run", "0")] if dry_run and report["succeeded"]
                else None, **await _incidents(request, who, filters, None))
