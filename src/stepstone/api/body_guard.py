"""Bounds a request's body, and authenticates an API request before its body is read.

FastAPI reads and parses a JSON body before it resolves a route's dependencies (the token among them), so
without this a request without a token could make the server read and parse any size of body first (a
122 MB body took 2.3 s and about 520 MB before its 401). This ASGI middleware, in front of every route:

- refuses a body over `body_limit(ctx.limits)` with 413 `BodyTooLarge` (problem+json): at once by its
  Content-Length, and by counting while it reads a body sent without one (chunked), never holding more
  than the limit;
- authenticates a request to the API that carries a body (``/api/v1``, not the UI's forms, which sign in
  with one) before reading it: 401 `Unauthenticated` without valid credentials (403 `NotLocal` from a
  no-auth server refusing another host or site; 503 when the database cannot be asked); the principal found is
  the one the route's `principal` dependency then uses (`PRINCIPAL_STATE`), so the token is looked up once.
- answers a state change to the API on a read-only server with its 405 `ReadOnly` before reading the
  body, as `writer` orders it (405 before 401): FastAPI would otherwise read, parse and validate the
  body first, answering a malformed one 422 and spending the parse on a request it refuses anyway.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stepstone.api.auth import ReadOnly
from stepstone.api.context import PRINCIPAL_STATE, context_of, principal, writable
from stepstone.api.methods import allowed_methods
from stepstone.api.problems import problem, stepstone_error_response
from stepstone.core.limits import Limits
from stepstone.errors import StepstoneError

__all__ = ["BodyGuard", "body_limit"]

_WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def body_limit(limits: Limits) -> int:
    """The largest request body, in bytes: four payloads' worth (1 MiB with the default 256 KiB). The
    largest bodies are a start-or-signal's, with an input and a signal payload of up to
    `max_payload_bytes` each, which JSON may write at up to twice their size (escaped characters), and a
    bulk action's 10,000 ids (about 400 KB)."""
    return 4 * limits.max_payload_bytes


class _TooLarge(Exception):
    pass


class BodyGuard:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _WRITES:
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        ctx = context_of(request)
        limit = body_limit(ctx.limits)
        too_large = problem(413, "BodyTooLarge", f"the request body exceeds the limit of {limit:,} bytes",
                            error="BodyTooLarge", what="body", limit=limit)
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            await too_large(scope, receive, send)
            return
        path, root = scope["path"], scope.get("root_path", "")
        api = (path[len(root):] if root and path.startswith(root) else path).startswith("/api/")
        if api and ctx.read_only and scope["method"] in allowed_methods(request).split(", "):
            try:
                writable(request)
            except ReadOnly as exc:  # raised here, outside the app's exception handlers
                await (await stepstone_error_response(request, exc))(scope, receive, send)
                return
        if api and not ctx.read_only:
            try:
                scope.setdefault("state", {})[PRINCIPAL_STATE] = await principal(request)
            except StepstoneError as exc:  # raised here, outside the app's exception handlers
                # 401, 403 NotLocal, and 503 when the token cannot be looked up (the database is away): the
                # mapping's status, as a route's lookup gets, not the 500 of an exception escaping the app.
                await (await stepstone_error_response(request, exc))(scope, receive, send)
                return
        try:
            body = await _read(receive, limit)
        except _TooLarge:
            await too_large(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)


async def _read(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away: the app sees an empty body
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the disconnect, when it comes

    return replayed
