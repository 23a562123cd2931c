"""What every UI page does first: learn the signed-in principal, check a posted form, redirect back."""

from __future__ import annotations

from urllib.parse import urlencode, urlsplit

from fastapi import Request
from starlette.datastructures import FormData
from starlette.responses import RedirectResponse

from stepstone.api.auth import Forbidden, Principal, Unauthenticated
from stepstone.api.context import context_of, writable
from stepstone.ui.render import csrf_token, flash_mac, query_of, ui_root

__all__ = ["back", "form_number", "from_this_site", "posted_form", "signed_in"]


async def signed_in(request: Request) -> Principal:
    """The principal of a UI request (its errors then render as pages); 401 goes to the sign-in page."""
    request.state.ui = True
    if request.method not in ("GET", "HEAD"):
        writable(request)  # a read-only server refuses a form whoever posts it, as the API's 405 comes before 401
    ctx = context_of(request)
    found = await (ctx.authenticate_ui or ctx.authenticate)(request)
    if found is None:
        raise Unauthenticated("sign in first")
    request.state.principal = found
    return found


async def posted_form(request: Request, who: Principal) -> FormData:
    """The posted form of a state-changing UI request: read-only 405, CSRF value checked, then its query,
    which no form takes (422 for any parameter, as the API refuses one its route does not take)."""
    writable(request)
    form = await request.form()
    if form.get("csrf") != csrf_token(request, who):
        raise Forbidden("this form is stale or was not sent by this site; reload the page and try again",
                        role="any", scope="*")
    query_of(request)
    return form


def from_this_site(request: Request) -> None:
    """Forbidden when the browser says the request comes from another site (its Origin names another
    host, or Sec-Fetch-Site says cross-site): sign-in and sign-out, which have no session to key a
    CSRF value by yet or any more. A program that sends neither header (curl) is let through. Then the
    query is checked (none is taken), as `posted_form` does."""
    origin = request.headers.get("origin")
    other = origin is not None and urlsplit(origin).netloc.lower() != request.headers.get("host", "").lower()
    if other or request.headers.get("sec-fetch-site") == "cross-site":
        raise Forbidden("this form was not sent by this site; open the sign-in page here and try again",
                        role="any", scope="*")
    query_of(request)  # sign-in and sign-out take no query, as no other form does (posted_form)


def form_number(value: object, most: int) -> int | None:
    """A form field's whole number from 1 to `most` (a version: int4; an event id: int8), else None.
    `str.isdigit` alone let '²' through to `int`, a ValueError, and a number past the column reached the
    store."""
    text = str(value or "").strip()
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= most:
        return None
    return int(text)


def back(request: Request, path: str, done: str | None = None) -> RedirectResponse:
    """Redirect to a UI page; `done` (words joined by ``+``) is the status message it shows, signed so
    that the page shows only messages the UI produced."""
    text = done.replace("+", " ") if done else ""
    suffix = f"?{urlencode({'done': text, 'sig': flash_mac(request, text)})}" if text else ""
    return RedirectResponse(f"{ui_root(request)}{path}{suffix}", status_code=303)
