"""The web UI's routes: thin over the same operations as the API (`stepstone.api.operations`).

Pages are server-rendered; the only script (`static/stepstone.js`) refreshes a page live from the
server-sent events of ``/ui/events``. Every form that changes something posts a CSRF value and, for
cancel, retry and bulk retry, goes through a confirmation page first. Sign-in keeps the API token in
an HTTP-only, SameSite=Strict cookie.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import Response, StreamingResponse
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from stepstone.api import operations as ops
from stepstone.api.auth import TOKEN_COOKIE, Principal, hash_token
from stepstone.api.context import context_of, require, visible_instance
from stepstone.core import json_text
from stepstone.core.limits import MAX_INT8
from stepstone.core.model import FAILURE_KINDS, STATUSES
from stepstone.errors import InvalidInput
from stepstone.ui import incident_pages, maintenance_pages, repair_pages, task_pages
from stepstone.ui.diagram import diagram, render_svg
from stepstone.ui.render import UI_PREFIX, flash_of, page, patch_lines, query_of, ui_root
from stepstone.ui.session import back, form_number, from_this_site, posted_form, signed_in

__all__ = ["install_ui", "router"]

router = APIRouter(prefix=UI_PREFIX, include_in_schema=False)
_LIVE_POLL_SECONDS = 2.0
_HISTORY_ON_PAGE = 500
STRANDED_WITHIN = 300.0
"""The definitions page's stranded report: versions no worker served in the last five minutes."""


# -- sign in --------------------------------------------------------------------------------------


@router.get("/login")
async def login_page(request: Request) -> Response:
    query_of(request)
    return page(request, "login.html", None)


@router.post("/login")
async def login(request: Request) -> Response:
    from_this_site(request)
    token = str((await request.form()).get("token", "")).strip()
    record = await context_of(request).management.token_by_hash(hash_token(token)) if token else None
    if record is None:
        return page(request, "login.html", None, status_code=401, error="That token is unknown or revoked.")
    response = back(request, "/")
    response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict", secure=request.url.scheme == "https",
                        path=ui_root(request))
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    from_this_site(request)
    response = back(request, "/login")
    response.delete_cookie(TOKEN_COOKIE, path=ui_root(request))
    return response


# -- instances ------------------------------------------------------------------------------------


@router.get("/")
async def instances_page(request: Request) -> Response:
    who = await signed_in(request)
    ctx = context_of(request)
    q = query_of(request, "status", "workflow", "business_key", "scope", "archived", "cursor", many=("status",))
    filters: dict[str, Any] = {k: (q.get(k) or None) for k in ("workflow", "business_key", "scope")}
    filters["status"] = _statuses(q.getlist("status"))
    archived = q.get("archived") == "1"
    listing = await ops.instances(ctx, who, statuses=filters["status"],
                                  workflow=filters["workflow"], business_key=filters["business_key"],
                                  scope=filters["scope"],
                                  cursor=q.get("cursor") or None, limit=50, include_archived=archived)
    counted = await ops.counts(ctx, who, filters["workflow"], archived, scope=filters["scope"],
                               business_key=filters["business_key"])
    counts = {s: f"{n:,}+" if s in counted["more_than"] else f"{n:,}" for s, n in counted["counts"].items()}
    total = sum(counted["counts"].values())
    return page(request, "instances.html", who, nav="instances", live="list", items=listing["items"],
                next_cursor=listing["next_cursor"], counts=counts,
                total=f"{total:,}+" if counted["more_than"] else f"{total:,}", filters=filters, statuses=STATUSES,
                archived=archived)


def _statuses(given: list[str]) -> list[str]:
    """The statuses the list is filtered by: every one given (``?status=FAILED&status=TIMED_OUT``, as the
    API's list takes them), each once; an empty one is none (the form's "any"), an unknown one refused."""
    wanted = list(dict.fromkeys(s.strip().upper() for s in given if s.strip()))
    unknown = [s for s in wanted if s not in STATUSES]
    if unknown:
        raise InvalidInput(f"status: {', '.join(unknown)} is not a status (statuses: {', '.join(STATUSES)})",
                           what="status")
    return wanted


@router.get("/instances/{instance_id}")
async def instance_page(request: Request, instance_id: str) -> Response:
    who = await signed_in(request)
    ctx = context_of(request)
    failed_only = query_of(request, "failed").get("failed") == "1"
    info = await ops.instance(ctx, who, instance_id)
    everything = await ctx.management.history_page(instance_id, after=0, limit=_HISTORY_ON_PAGE + 1,
                                                   failed_only=False)
    # Failures only: the store's, as the API's failed_only, not those of the entries read for the graph.
    shown = await ctx.management.history_page(instance_id, after=0, limit=_HISTORY_ON_PAGE + 1,
                                              failed_only=True) if failed_only else everything
    pending = await ctx.management.commands_page(instance_id, after=0, limit=200,
                                                 states=["PENDING", "DEFERRED", "CLAIMED", "PARKED", "DEAD"])
    events = await ctx.management.instance_outbox(instance_id, after=0, limit=200)
    # The registry row the instance is pinned to: its own scope's, or the default scope's it was admitted on.
    pin = await ctx.store.definitions.pinned_contract(instance_id)
    plan = await ctx.management.definition_plan(pin["scope"], pin["definition_id"], pin["version"]) if pin else None
    picture = diagram(plan["plan"] if plan else {}, info["positions"], everything, status=info["status"],
                      children=info["children"])
    svg = render_svg(picture, title=f"{info['definition_id']} v{info['version']}",
                     link=f"{ui_root(request)}/instances/")
    wait = info["waiting_for"] or {}
    signals = sorted((wait.get("signals") or {}) if isinstance(wait, dict) else {})
    return page(request, "instance.html", who, nav="instances", live=info["id"], i=info,
                stamp=stamp_of((info["status"], info["updated_at"])),
                history=[{**h, "patch": patch_lines(h["data"]), "bad": h["kind"] in FAILURE_KINDS}
                         for h in shown[:_HISTORY_ON_PAGE]],
                history_more=len(shown) > _HISTORY_ON_PAGE, failed_only=failed_only, pending=pending,
                events=events, svg=svg, signals=signals, waiting=_describe_wait(wait),
                branches=[p for p in info["positions"] if p["path"]])


def _describe_wait(wait: Any) -> str:
    if not isinstance(wait, dict) or not wait:
        return ""
    if wait.get("kind") == "signal":
        return "signal " + " or ".join(sorted(wait.get("signals") or {}))
    if wait.get("kind") == "timer":
        return "a timer"
    return str(wait.get("kind", ""))


_ACTIONS = {
    "retry": ("Retry this instance?", "Its failed step runs again.", "Retry", False),
    "cancel": ("Cancel this instance?", "It stops where it is; branches and children are cancelled too.",
               "Cancel instance", True),
}


@router.get("/instances/{instance_id}/confirm/{action}")
async def confirm_page(request: Request, instance_id: str, action: str) -> Response:
    who = await signed_in(request)
    query_of(request)
    if action not in _ACTIONS:
        raise InvalidInput(f"no action {action!r}", what="action")
    info = await ops.instance(context_of(request), who, instance_id)
    heading, question, label, danger = _ACTIONS[action]
    root = ui_root(request)
    return page(request, "confirm.html", who, action=action, heading=heading,
                question=f"{info['definition_id']} {info['id']} is {info['status'].lower()}. {question}",
                target=f"{root}/instances/{instance_id}/{action}", back=f"{root}/instances/{instance_id}",
                confirm_label=label, danger=danger, reason=action == "cancel", compensate=action == "cancel",
                hidden=[], items=[], scope=info["scope"])


@router.post("/instances/{instance_id}/retry")
async def retry(request: Request, instance_id: str) -> Response:
    who = await signed_in(request)
    await posted_form(request, who)
    await ops.retry(context_of(request), who, instance_id)
    return back(request, f"/instances/{instance_id}", "retry+scheduled")


@router.post("/instances/{instance_id}/cancel")
async def cancel(request: Request, instance_id: str) -> Response:
    who = await signed_in(request)
    form = await posted_form(request, who)
    compensate = form.get("compensate") == "1"  # as `stepstone cancel --compensate` and the API's
    done = await ops.cancel(context_of(request), who, instance_id, str(form.get("reason", "")),
                            compensate=compensate)
    said = {"CANCELLED": "cancelled", "COMPENSATING": "compensating"}  # else nothing changed: say its status
    return back(request, f"/instances/{instance_id}",
                said.get(done["status"], f"nothing+changed,+still+{str(done['status']).lower()}"))


@router.get("/instances/{instance_id}/signal")
async def signal_page(request: Request, instance_id: str) -> Response:
    who = await signed_in(request)
    query_of(request)
    info = await ops.instance(context_of(request), who, instance_id)
    return _signal_form(request, who, info, "", "", None)


def _signal_form(request: Request, who: Principal, info: dict[str, Any], chosen: str, payload: str,
                 error: str | None) -> Response:
    wait = info["waiting_for"] if isinstance(info["waiting_for"], dict) else {}
    signals = sorted(wait.get("signals") or {}) or ([chosen] if chosen else [])
    live = [p for p in info["positions"] if p["status"] in ("WAITING", "RUNNING")] or info["positions"][:1]
    return page(request, "signal.html", who, i=info, signals=signals, chosen=chosen, payload=payload,
                positions=live, error=error, status_code=422 if error else 200)


@router.post("/instances/{instance_id}/signal")
async def send_signal(request: Request, instance_id: str) -> Response:
    who = await signed_in(request)
    form = await posted_form(request, who)
    ctx = context_of(request)
    name, text = str(form.get("name", "")), str(form.get("payload", "")).strip()
    try:
        payload = json_text.parse(text) if text else None
    except json.JSONDecodeError as exc:
        info = await ops.instance(ctx, who, instance_id)
        return _signal_form(request, who, info, name, text, f"The payload is not JSON: {exc.msg}.")
    await ops.signal(ctx, who, instance_id, name, payload, dedup_key=None, position=str(form.get("position", "")))
    return back(request, f"/instances/{instance_id}", f"signal+{name}+sent")


# -- definitions ----------------------------------------------------------------------------------


@router.get("/definitions")
async def definitions_page(request: Request) -> Response:
    who = await signed_in(request)
    cursor = query_of(request, "cursor").get("cursor") or None
    listing = await ops.definitions(context_of(request), who, cursor=cursor, limit=100)
    stranded = await ops.stranded(context_of(request), who, STRANDED_WITHIN)
    return page(request, "definitions.html", who, nav="definitions", plan=None, stranded=stranded,
                stranded_within=int(STRANDED_WITHIN), **listing)


@router.get("/definitions/{scope}/{definition_id}/{version}")
async def definition_page(request: Request, scope: str, definition_id: str, version: int) -> Response:
    who = await signed_in(request)
    query_of(request)
    found = await ops.definition_plan(context_of(request), who, scope, definition_id, version)
    svg = render_svg(diagram(found["plan"], [], []), title=f"{definition_id} v{version}")
    return page(request, "definitions.html", who, nav="definitions", plan=found, svg=svg)


# -- outbox ---------------------------------------------------------------------------------------


@router.get("/outbox")
async def outbox_page(request: Request) -> Response:
    who = await signed_in(request)
    query_of(request)
    ctx = context_of(request)
    if ctx.outbox is None or not who.can("viewer", "*"):
        return page(request, "outbox.html", who, nav="outbox", forbidden=True)
    status = await ctx.outbox.summary()
    dead = [r.as_dict() for r in await ctx.outbox.unpublished(dead=True, limit=200)]
    return page(request, "outbox.html", who, nav="outbox", forbidden=False, status=status, dead=dead,
                results=flash_of(request))


@router.post("/outbox/requeue")
async def outbox_requeue(request: Request) -> Response:
    who = await signed_in(request)
    form = await posted_form(request, who)
    require(who, "operator", "*")
    ctx = context_of(request)
    ids = sorted({n for n in (form_number(v, MAX_INT8) for v in form.getlist("id")) if n is not None})
    done = await ctx.outbox.requeue(ids) if ctx.outbox is not None and ids else []
    return back(request, "/outbox", f"requeued+{len(done)}+of+{len(ids)}+event(s)")


# -- live updates ---------------------------------------------------------------------------------


@router.get("/events")
async def events(request: Request) -> Response:
    """Server-sent events: ``changed`` with an instance id when one settles (LISTEN/NOTIFY), and for
    an instance page also when its status or update time moves (checked every 2 s as a fallback)."""
    who = await signed_in(request)
    ctx = context_of(request)
    q = query_of(request, "instance", "stamp")
    watched = q.get("instance")
    if watched:
        await visible_instance(ctx, who, watched)  # (InstanceNotFound for a text that spells no id)
        # Any spelling of the id finds the instance (upper case, no hyphens); a notification carries the
        # database's, which must match the watched id for the stream to hear it.
        watched = str(uuid.UUID(watched))
    return StreamingResponse(_stream(request, who, watched, q.get("stamp")),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def stamp_of(found: tuple[str, Any] | None) -> str:
    """What the page was rendered from (status and update time), so a change before the stream opened
    is not missed."""
    return "" if found is None else f"{found[0]}|{found[1].isoformat()}"


async def _visible(request: Request, who: Principal, instance_id: str) -> bool:
    """Whether the list's stream may name the instance: a notification carries only its id, and an
    instance of a scope the caller cannot see does not exist for it."""
    if who.visible_scopes() is None:
        return True
    scope = await context_of(request).management.instance_scope(instance_id)
    return scope is not None and who.sees(scope)


async def _stream(request: Request, who: Principal, watched: str | None, seen: str | None) -> AsyncIterator[str]:
    ctx = context_of(request)
    queue = await ctx.broadcaster.subscribe() if ctx.broadcaster is not None else asyncio.Queue[str]()
    stamp = seen or (stamp_of(await ctx.management.instance_stamp(watched)) if watched else "")
    authenticate = ctx.authenticate_ui or ctx.authenticate
    loop = asyncio.get_running_loop()
    checked = loop.time()
    try:
        yield "retry: 3000\n\n"
        while not await request.is_disconnected():
            changed: str | None = None
            with contextlib.suppress(TimeoutError):  # not wait_for: on 3.11 it can lose a cancellation
                async with asyncio.timeout(_LIVE_POLL_SECONDS):
                    changed = await queue.get()
            # A token revoked while the page is open ends its stream (one lookup per poll interval at
            # most); the browser's reconnection then meets the sign-in page.
            if loop.time() - checked >= _LIVE_POLL_SECONDS:
                if await authenticate(request) is None:
                    return
                checked = loop.time()
            if watched:
                now = stamp_of(await ctx.management.instance_stamp(watched))
                if changed == watched or now != stamp:
                    stamp = now
                    yield f"event: changed\ndata: {watched}\n\n"
                    continue
            elif changed is not None and await _visible(request, who, changed):
                yield f"event: changed\ndata: {changed}\n\n"
                continue
            yield ": keep-alive\n\n"
    finally:
        if ctx.broadcaster is not None:
            ctx.broadcaster.unsubscribe(queue)


# -- wiring ---------------------------------------------------------------------------------------


def html_error(request: Request, status: int, title: str, detail: str) -> Response | None:
    """A UI request's error as a page (401: to the sign-in page); None for any other request (the API's
    problem+json). A request is the UI's when a UI route began it or its path is under /ui: a path no
    route has, or one whose parameters FastAPI refused before the route ran."""
    path, root = request.scope.get("path", ""), request.scope.get("root_path", "")
    path = path.removeprefix(root) if root else path
    if not getattr(request.state, "ui", False) and path != UI_PREFIX and not path.startswith(f"{UI_PREFIX}/"):
        return None
    if status == 401:
        return back(request, "/login")
    who = getattr(request.state, "principal", None)
    return page(request, "error.html", who, status_code=status, title=title, detail=detail)


class _StaticFiles(StaticFiles):
    """The UI's script and style sheet. A missing file (or a method other than GET and HEAD) raises as
    every UI request does, so it is the UI's error page: the mount had already set the scope's root path
    to ``.../ui/static`` (which hid the request from `html_error` and would misplace the page's links),
    so it is set back to the app's first."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except HTTPException:
            scope["root_path"] = scope.get("root_path", "").removesuffix(f"{UI_PREFIX}/static")
            scope.setdefault("state", {})["ui"] = True
            raise


def install_ui(app: FastAPI) -> None:
    app.include_router(router)
    app.include_router(task_pages.router)
    app.include_router(incident_pages.router)
    app.include_router(repair_pages.router)
    app.include_router(maintenance_pages.router)
    app.mount(f"{UI_PREFIX}/static", _StaticFiles(directory=Path(__file__).parent / "static"), name="ui-static")
    app.state.html_error = html_error
