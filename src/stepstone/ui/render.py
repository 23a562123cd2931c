"""Templates and the small helpers they use (times, JSON, patches); no logic lives in the templates."""

from __future__ import annotations

import hashlib
import hmac
import json
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

import orjson
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import HTMLResponse

from stepstone.api.app import API_PREFIX
from stepstone.api.auth import TOKEN_COOKIE, Principal, TokenAuth
from stepstone.api.context import context_of
from stepstone.api.query_params import query_refusals
from stepstone.core.attribution import Actor
from stepstone.core.failures import traceback_text, without_frames
from stepstone.errors import InvalidInput
from stepstone.ids import short_id

__all__ = ["UI_PREFIX", "csrf_token", "flash_mac", "flash_of", "page", "patch_lines", "query_of", "refusal",
           "ui_root"]

UI_PREFIX = "/ui"
_env = Environment(loader=PackageLoader("stepstone.ui", "templates"), autoescape=select_autoescape(["html"]))


def _who(actor: str | None) -> str:
    """An actor as a person reads it: the id, with the kind when it is not a user (a worker's
    attribution is stored as JSON)."""
    parsed = Actor.parse(actor)
    if parsed is None:
        return ""
    return parsed.id if parsed.kind == "user" else f"{parsed.kind} {parsed.id}"


_env.filters["who"] = _who
_env.filters["short"] = short_id


def _when(value: datetime | None, millis: bool = False) -> str:
    if value is None:
        return ""
    text = value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
    return (text[:-3] if millis else text[:-7]) + "Z"


def _pretty(value: Any) -> str:
    # orjson where it can: with an indent the standard encoder runs in Python, and a state of a few
    # thousand entries spent 80% of its instance page's time there (docs/api.md, "Measured"). Dates and
    # dataclasses go to `str` as before; what orjson refuses (an integer beyond 64 bits, a key that is
    # not a string) is written by the standard encoder.
    try:
        return orjson.dumps(value, default=str, option=_PRETTY).decode()
    except TypeError:
        return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


_PRETTY = (orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_DATETIME
           | orjson.OPT_PASSTHROUGH_DATACLASS)


def _compact(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    return text if len(text) <= 400 else text[:399] + "…"


_env.globals.update(when=_when, pretty=_pretty, compact=_compact, without_frames=without_frames,
                    traceback=traceback_text)


def patch_lines(data: Any) -> list[str]:
    """An RFC 6902 patch as lines a person reads: ``replace /outcome = "shipped"``."""
    patch = data.get("patch") if isinstance(data, dict) else None
    if not isinstance(patch, list):
        return []
    lines = []
    for op in patch:
        if not isinstance(op, dict):
            continue
        value = f" = {_compact(op['value'])}" if "value" in op else ""
        source = f" from {op['from']}" if "from" in op else ""
        lines.append(f"{op.get('op', '?')} {op.get('path', '')}{source}{value}")
    return lines


def ui_root(request: Request) -> str:
    return f"{request.scope.get('root_path', '')}{UI_PREFIX}"


def _key(request: Request) -> bytes:
    """What the UI's own values are keyed by: the sign-in cookie's token (the same on every replica), or,
    behind a host's authentication (or --no-auth), the app's `ui_secret`."""
    ctx = context_of(request)
    cookie = request.cookies.get(TOKEN_COOKIE)
    # Only where the UI signs in with that cookie is it a secret: behind a host's authentication anyone able
    # to set a cookie for this path (a sibling site of the domain) could plant one and compute every value.
    signs_in = isinstance(ctx.authenticate_ui, TokenAuth) and ctx.authenticate_ui.cookie
    return cookie.encode("utf-8", "surrogatepass") if cookie and signs_in else ctx.ui_secret


def csrf_token(request: Request, who: Principal) -> str:
    """The value every UI form carries back, which a cross-site form cannot know: keyed by `_key` and
    the actor."""
    return hmac.new(_key(request), f"stepstone-csrf\n{who.actor}".encode(), hashlib.sha256).hexdigest()[:40]


def flash_mac(request: Request, text: str) -> str:
    """The signature of a status message the UI itself produced (`session.back`), for `flash_of`."""
    return hmac.new(_key(request), f"stepstone-flash\n{text}".encode("utf-8", "surrogatepass"),
                    hashlib.sha256).hexdigest()[:32]


def flash_of(request: Request) -> str | None:
    """The status message of ``?done=`` when the UI signed it; any other text (a link that makes the
    page say "re-enter your token at https://evil.example") is not shown."""
    text, mac = request.query_params.get("done"), request.query_params.get("sig", "")
    return text if text and hmac.compare_digest(mac.encode(), flash_mac(request, text).encode()) else None


_ON_EVERY_PAGE = ("done", "sig")  # the signed status message a redirect leaves (flash_of)


def query_of(request: Request, *takes: str, many: tuple[str, ...] = ()) -> QueryParams:
    """The query of a page or form that takes the parameters `takes` (none: a page without filters), of
    which `many` may be given more than once. A parameter it does not take (a misspelled filter,
    ``?stauts=FAILED``), or a repeat of one that takes one value (``?workflow=a&workflow=b``, which read only
    one of them), is refused, 422 on the error page, as the API refuses it (`query_refusals`), rather than
    ignored. Every GET page calls it, and every form (`session.posted_form`, sign-in and sign-out)."""
    single = [name for name in (*takes, *_ON_EVERY_PAGE) if name not in many]
    errors = query_refusals((name for name, _ in request.query_params.multi_items()), takes, single,
                            of="page", also=_ON_EVERY_PAGE)
    if errors:
        raise InvalidInput("; ".join(f"{e['loc'][1]}: {e['msg']}" for e in errors), what=errors[0]["loc"][1])
    return request.query_params


def refusal(read_only: bool, who: Principal | None, role: str, scope: str | None = None) -> str:
    """Why the page offers no action needing `role` in `scope` (None: in some scope), or "" when it may
    act: the one place the UI decides which buttons and forms to show. The server refuses the rest."""
    if read_only:
        return "This server is read-only."
    if who is None:
        return "Sign in first."
    scopes = list(who.grants) if scope is None else [scope]
    if any(who.can(role, s) for s in scopes):
        return ""
    held = who.role_in(scope) if scope is not None else None
    here = f"Your role here is {held}" if held else "Your token has no role here"
    return f"{here}: actions need {role.replace('_', ' ')}."


def page(request: Request, template: str, who: Principal | None, *, status_code: int = 200,
         **values: Any) -> HTMLResponse:
    ctx = context_of(request)

    def why_not(role: str, scope: str | None = None) -> str:
        return refusal(ctx.read_only, who, role, scope)
    root = request.scope.get("root_path", "")

    def query(**changes: Any) -> str:
        """The page's query with `changes`, each in its parameter's place (None drops one, a list gives it
        several values); a parameter given several times keeps every value (the list's statuses)."""
        pairs: list[tuple[str, Any]] = []
        for key, value in [*request.query_params.multi_items(), *((k, None) for k in changes)]:
            if key not in changes:
                pairs.append((key, value))
            elif key not in {k for k, _ in pairs}:
                changed = changes[key]
                pairs += [(key, v) for v in (changed if isinstance(changed, list) else [changed])]
        return urlencode([(k, v) for k, v in pairs if v not in (None, "")])

    html = _env.get_template(template).render(
        ui=ui_root(request), api=f"{root}{API_PREFIX}", who=who, read_only=ctx.read_only,
        csrf=csrf_token(request, who) if who else "", query=query, why_not=why_not,
        flash=flash_of(request),
        **values)
    return HTMLResponse(html, status_code=status_code, headers=_PAGE_HEADERS)


_PAGE_HEADERS = {
    "Cache-Control": "no-store",
    # No other site may show a page in a frame and have the user click its buttons there (clickjacking): the
    # frame's requests would be this origin's, with the page's CSRF value, as the local admin of --no-auth.
    "X-Frame-Options": "SAMEORIGIN",
    "Content-Security-Policy": "frame-ancestors 'self'",
}
