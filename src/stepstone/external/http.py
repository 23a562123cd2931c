"""External tasks over HTTP: a small ASGI app (Starlette, extra ``stepstone[external]``) so a worker in
any language takes part with an HTTP client. `stepstone external serve` runs it; a host app may
mount `create_app(tasks)` under a prefix.

    POST /external-tasks/fetch-and-lock      {"worker_id", "topics": [...], "max_tasks", "lock_duration",
                                              "timeout"}                     -> {"tasks": [...]}
    POST /external-tasks/{id}/extend-lock    {"lock_token", "lock_duration"}  -> {"lock_until"}
    POST /external-tasks/{id}/complete       {"lock_token", "variables", "worker_id"}
    POST /external-tasks/{id}/business-error {"lock_token", "code", "message", "variables", "details",
                                              "worker_id"}
    POST /external-tasks/{id}/failure        {"lock_token", "message", "details", "retries", "retry_delay",
                                              "worker_id"}
    GET  /external-tasks?topic=&status=&instance_id=&limit=&cursor=
    GET  /health

A body takes only its fields, and the list only its parameters: any other is refused (400), naming it.
Errors are one JSON object `{"error": <kind>, "message": <one line>}` with a status that says what
to do: 400 bad input, 401 no or wrong bearer token, 404 no such task (or path: `not_found`), 405 a
method the path does not take (`method_not_allowed`), 409 the lock token was refused (`error` is
lock_lost, lock_expired, not_open or not_awaited), 413 a body over 1 MiB (`body_too_large`), 503 the
database cannot be reached.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stepstone._waiting import cancel_and_wait
from stepstone.core import json_text
from stepstone.errors import InvalidInput, NotFound, PayloadTooLarge, StepstoneError, TaskLockRefused, Unavailable
from stepstone.external.tasks import ExternalTasks, LockedTask

__all__ = ["create_app"]

log = logging.getLogger("stepstone.external.http")
MAX_BODY_BYTES = 1024 * 1024
_DISCONNECT_CHECK = 0.5  # seconds between looks at whether a long-polling client is still there

Handler = Callable[[Request], Awaitable[Any]]


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"error": kind, "message": message}, status_code=status)


def _translated(exc: StepstoneError) -> JSONResponse:
    """The one mapping of the error tree to HTTP statuses."""
    if isinstance(exc, TaskLockRefused):
        return JSONResponse({"error": exc.reason, "message": str(exc), "task_id": exc.task_id, "status": exc.status},
                            status_code=409)
    if isinstance(exc, NotFound):
        return _error(404, "not_found", str(exc))
    if isinstance(exc, PayloadTooLarge) and exc.what == "body":
        return _error(413, "body_too_large", str(exc))
    if isinstance(exc, InvalidInput):
        return _error(400, "invalid_input", str(exc))
    if isinstance(exc, Unavailable):
        return _error(503, "unavailable", str(exc))
    log.error("external task request failed: %s: %s", type(exc).__name__, exc)
    return _error(500, "internal", f"{type(exc).__name__}: {exc}")


_HTTP_KINDS = {404: "not_found", 405: "method_not_allowed"}


async def _http_error(_: Request, exc: Exception) -> Response:
    """A path or a method the app does not have, as every other error: one JSON object (not Starlette's text)."""
    assert isinstance(exc, HTTPException)
    response = _error(exc.status_code, _HTTP_KINDS.get(exc.status_code, "http_error"), str(exc.detail))
    response.headers.update(exc.headers or {})
    return response


def _endpoint(handler: Handler, token: str | None) -> Callable[[Request], Awaitable[Response]]:
    expected = f"Bearer {token}".encode() if token else None

    async def run(request: Request) -> Response:
        if expected is not None:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return _error(401, "unauthorized", "a valid 'Authorization: Bearer <token>' header is required")
        try:
            return JSONResponse(await handler(request))
        except StepstoneError as exc:
            return _translated(exc)

    return run


async def _unless_gone(request: Request, work: Awaitable[list[LockedTask]]) -> list[LockedTask]:
    """Run a long poll, and give it up when the client goes away: tasks locked for a worker that
    left would wait out their lock."""
    job = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({job}, timeout=_DISCONNECT_CHECK)
            if done:
                return job.result()
            if await request.is_disconnected():
                # A cancellation of this request's task while the fetch ends is raised (the fetch's own is not).
                await cancel_and_wait(job)
                return []
    finally:
        if not job.done():
            job.cancel()


async def _body(request: Request, *fields: str) -> dict[str, Any]:
    """The request's JSON object, which takes these fields only: a misspelled one is refused, never dropped
    (a `lock_duraton` would have locked the task for the default time). Read no further than
    MAX_BODY_BYTES: a larger body is refused by its Content-Length before any of it is read, or as it
    arrives when it has none (chunked)."""
    too_large = PayloadTooLarge(f"the request body exceeds the limit of {MAX_BODY_BYTES:,} bytes", what="body")
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
        raise too_large
    buffer = bytearray()
    async for chunk in request.stream():
        buffer += chunk
        if len(buffer) > MAX_BODY_BYTES:
            raise too_large
    raw = bytes(buffer)
    if not raw.strip():
        return {}
    try:
        data = json_text.parse(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"request body is not JSON: {exc}", what="body") from None
    if not isinstance(data, dict):
        raise InvalidInput("request body must be a JSON object", what="body")
    _only(data, fields, "field")
    return data


def _only(given: Any, takes: tuple[str, ...], what: str) -> None:
    unknown = next((name for name in given if name not in takes), None)
    if unknown is not None:
        raise InvalidInput(f"unknown {what} {unknown!r} (this request takes: {', '.join(sorted(takes))})",
                           what=unknown)


def _required(data: dict[str, Any], name: str) -> Any:
    if name not in data or data[name] is None:
        raise InvalidInput(f"{name} is required", what=name)
    return data[name]


def create_app(tasks: ExternalTasks, *, token: str | None = None) -> Starlette:
    """The ASGI app over `tasks`. With `token`, every request but /health needs `Authorization: Bearer <token>`."""

    async def fetch_and_lock(request: Request) -> Any:
        data = await _body(request, "worker_id", "topics", "topic", "max_tasks", "lock_duration", "timeout")
        topics = data.get("topics", data.get("topic"))
        locked = await _unless_gone(request, tasks.fetch_and_lock(
            _required(data, "worker_id"), _required({"topics": topics}, "topics"),
            max_tasks=data.get("max_tasks", 1), lock_duration=data.get("lock_duration", 30.0),
            timeout=data.get("timeout", 0.0)))
        return {"tasks": [t.as_dict() for t in locked]}

    async def extend_lock(request: Request) -> Any:
        data = await _body(request, "lock_token", "lock_duration")
        until = await tasks.extend_lock(request.path_params["task_id"], _required(data, "lock_token"),
                                        _required(data, "lock_duration"))
        return {"task_id": request.path_params["task_id"], "lock_until": until.isoformat()}

    async def complete(request: Request) -> Any:
        data = await _body(request, "lock_token", "variables", "worker_id")
        answer = await tasks.complete(request.path_params["task_id"], _required(data, "lock_token"),
                                      data.get("variables"), worker_id=data.get("worker_id"))
        return answer.as_dict()

    async def business_error(request: Request) -> Any:
        data = await _body(request, "lock_token", "code", "message", "variables", "details", "worker_id")
        answer = await tasks.raise_error(
            request.path_params["task_id"], _required(data, "lock_token"), _required(data, "code"),
            data.get("message", ""), variables=data.get("variables"), details=data.get("details"),
            worker_id=data.get("worker_id"))
        return answer.as_dict()

    async def failure(request: Request) -> Any:
        data = await _body(request, "lock_token", "message", "details", "retries", "retry_delay", "worker_id")
        answer = await tasks.fail(
            request.path_params["task_id"], _required(data, "lock_token"), data.get("message", ""),
            details=data.get("details"), retries=data.get("retries"), retry_delay=data.get("retry_delay"),
            worker_id=data.get("worker_id"))
        return answer.as_dict()

    async def listing(request: Request) -> Any:
        q = request.query_params
        _only(q, ("topic", "status", "instance_id", "limit", "cursor"), "parameter")
        try:
            limit = int(q.get("limit", "50"))
        except ValueError:
            raise InvalidInput(f"limit must be an integer, got {q.get('limit')!r}", what="limit") from None
        found = await tasks.page(topic=q.get("topic"), status=q.get("status"), instance_id=q.get("instance_id"),
                                 limit=limit, after=q.get("cursor"))
        return {"tasks": [{k: v.isoformat() if hasattr(v, "isoformat") else v for k, v in t.items()}
                          for t in found.tasks], "next_cursor": found.next_cursor}

    async def health(_: Request) -> Any:
        return {"status": "ok"}

    routes = [
        Route("/health", _endpoint(health, None), methods=["GET"]),
        Route("/external-tasks", _endpoint(listing, token), methods=["GET"]),
        Route("/external-tasks/fetch-and-lock", _endpoint(fetch_and_lock, token), methods=["POST"]),
        Route("/external-tasks/{task_id}/extend-lock", _endpoint(extend_lock, token), methods=["POST"]),
        Route("/external-tasks/{task_id}/complete", _endpoint(complete, token), methods=["POST"]),
        Route("/external-tasks/{task_id}/business-error", _endpoint(business_error, token), methods=["POST"]),
        Route("/external-tasks/{task_id}/failure", _endpoint(failure, token), methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
