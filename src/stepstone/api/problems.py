"""The one mapping from stepstone's error tree to HTTP: status codes and problem+json bodies (RFC 9457).

    Unauthenticated 401   Forbidden, NotLocal, TaskNotPermitted 403   NotFound 404   ReadOnly 405   Conflict 409
    InvalidInput 422      Unavailable 503 WaitTimeout 504  ConfigError, InternalError, anything else 500

A body is ``{"type", "title", "status", "detail", "error", ...}``: ``error`` is the class name (what a
program branches on) and the leaf's typed attributes follow (``instance_id``, ``what``...; InvalidState's
instance status as ``instance_status``, a task error's task status as ``task_status``).
An instance of another scope is NotFound, exactly like one that does not exist. A request of the web UI
gets the same status as an HTML page instead (the `html_error` hook `stepstone.ui` installs).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from stepstone.api.auth import Forbidden, NotLocal, ReadOnly, Unauthenticated
from stepstone.api.methods import SAFE_METHODS, allowed_methods
from stepstone.errors import (
    ConfigError,
    Conflict,
    DatabaseUnavailable,
    InvalidInput,
    NotFound,
    StepstoneError,
    TaskNotPermitted,
    Unavailable,
    WaitTimeout,
)

__all__ = ["PROBLEM_JSON", "install_problem_handlers", "problem", "status_of", "stepstone_error_response"]

log = logging.getLogger("stepstone.api")
PROBLEM_JSON = "application/problem+json"
_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    # TaskNotPermitted is a refusal of who asks, not a conflict with what is stored: 403 before Conflict.
    (Unauthenticated, 401), (Forbidden, 403), (NotLocal, 403), (TaskNotPermitted, 403), (NotFound, 404),
    (ReadOnly, 405), (Conflict, 409),
    (InvalidInput, 422), (Unavailable, 503), (WaitTimeout, 504), (ConfigError, 500),
)
_KEBAB = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")  # HTTPError -> http-error


def status_of(exc: BaseException) -> int:
    return next((code for cls, code in _STATUS if isinstance(exc, cls)), 500)


_RESERVED = {"type", "title", "status", "detail", "instance", "error"}


def _attributes(exc: BaseException) -> dict[str, Any]:
    """The leaf's typed attributes; one named like a problem member is renamed after what it belongs to:
    a task error's `status` (TaskRefused: TaskNotOpen, TaskNotPermitted...) is the task's, `task_status`;
    any other's (InvalidState's) is the instance's, `instance_status`. A task error's `completion` (a
    mapping) is kept: TaskNotOpen carries the completion that won."""
    found = {k: v for k, v in vars(exc).items()
             if not k.startswith("_") and isinstance(v, str | int | float | bool | type(None) | tuple | list | dict)}
    owner = "task" if "task_id" in found else "instance"
    encoded: dict[str, Any] = jsonable_encoder({(f"{owner}_{k}" if k in _RESERVED else k): v
                                                for k, v in found.items()})  # a completion's instants
    return encoded


def problem(status: int, title: str, detail: str, *, headers: dict[str, str] | None = None,
            **extra: Any) -> JSONResponse:
    body = {"type": f"urn:stepstone:problem:{_KEBAB.sub('-', title).lower()}", "title": title,
            "status": status, "detail": detail, **extra}
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def error_response(exc: StepstoneError, status: int, name: str, detail: str, *, allow: str = "") -> JSONResponse:
    """`allow`: a 405's Allow header (for ReadOnly, the path's GET and HEAD; empty when it has neither)."""
    headers: dict[str, str] = {}
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="stepstone"'
    if status == 405:
        headers["Allow"] = allow
    return problem(status, name, detail, headers=headers or None, error=name, **_attributes(exc))


def _page(request: Request, status: int, title: str, detail: str) -> Response | None:
    """The error as the UI's page when the request is the UI's (the hook `install_ui` sets decides), else
    None: a UI page's error is a page, not problem+json."""
    html = getattr(request.app.state, "html_error", None)
    response: Response | None = None if html is None else html(request, status, title, detail)
    return response


async def stepstone_error_response(request: Request, exc: Exception) -> Response:
    """A StepstoneError as the API answers it (an exception handler: the UI's page for a UI request)."""
    assert isinstance(exc, StepstoneError)
    if isinstance(exc, DatabaseUnavailable):
        # Where the database lives is the operators' to know (the store logs the outage), not any caller's:
        # /health answers without a token, and every request meets an outage before its token is known.
        exc = DatabaseUnavailable("the database cannot be reached now; try again later")
    status, name = status_of(exc), type(exc).__name__
    detail = str(exc).splitlines()[0] if str(exc) else name
    if status == 500 and not isinstance(exc, ConfigError):
        log.error("request failed: %s: %s", name, detail)
    allow = ", ".join(m for m in allowed_methods(request).split(", ") if m in SAFE_METHODS) if status == 405 else ""
    page = _page(request, status, name, detail)
    if page is not None and status == 405:
        page.headers["Allow"] = allow
    return page or error_response(exc, status, name, detail, allow=allow)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
              for e in exc.errors()]
    first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
    where = ".".join(str(p) for p in first["loc"])
    detail = f"{where}: {first['msg']}" if where else str(first["msg"])
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    extra: dict[str, Any] = {}
    if first["loc"] == ["body"] and media and not _is_json(media):
        # FastAPI hands such a body over as bytes, which no body model takes: say what to change
        detail = (f"body: sent as {media[:100]}, which the API does not read: send JSON, with Content-Type: "
                  "application/json")
        extra = {"what": "body"}
    return _page(request, 422, "InvalidInput", detail) or problem(422, "InvalidInput", detail,
                                                                  error="InvalidInput", errors=errors, **extra)


def _is_json(media: str) -> bool:
    """Whether FastAPI reads a body of this media type as JSON (application/json, application/*+json)."""
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
        # FastAPI's "error parsing the body" of a body that is not UTF-8: not JSON, so 422 as any other
        # such body (docs/api.md); 400 stays for a body nested too deeply to parse.
        detail = f"body: not valid UTF-8 JSON ({exc.__cause__.reason} at byte {exc.__cause__.start})"
        return _page(request, 422, "InvalidInput", detail) or problem(
            422, "InvalidInput", detail, error="InvalidInput", what="body",
            errors=[{"loc": ["body"], "msg": "not valid UTF-8", "type": "json_invalid"}])
    title = {400: "BadRequest", 404: "NotFound", 405: "MethodNotAllowed"}.get(exc.status_code, "HTTPError")
    headers = dict(exc.headers or {}) or None
    if exc.status_code == 405:  # every method of the path, not only those of its first route
        headers = {**(headers or {}), "Allow": allowed_methods(request)}
    page = _page(request, exc.status_code, title, str(exc.detail))
    if page is not None:
        page.headers.update(headers or {})
        return page
    return problem(exc.status_code, title, str(exc.detail), headers=headers, error=title)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error("unexpected error in a request", exc_info=exc)
    detail = "an unexpected error occurred; the server log has the details"
    return _page(request, 500, "InternalError", detail) or problem(500, "InternalError", detail,
                                                                   error="InternalError")


def install_problem_handlers(app: FastAPI) -> None:
    app.add_exception_handler(StepstoneError, stepstone_error_response)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
