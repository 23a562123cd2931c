"""The app factory: one ASGI app from its parts (stores, workflows, auth policy), API and UI.

    app = create_app(ApiContext(store, management, authenticate=TokenAuth(management), ...))

The API lives under ``/api/v1`` (OpenAPI at ``/api/v1/openapi.json``, docs at ``/api/v1/docs``), the UI
under ``/ui``. The app can be served by `stepstone serve`, or mounted into a host application
(``host.mount("/workflows", app)``) behind the host's own authentication (docs/api.md).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import version
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.responses import RedirectResponse

from stepstone.api.body_guard import BodyGuard
from stepstone.api.context import ApiContext
from stepstone.api.methods import answer_head
from stepstone.api.problems import install_problem_handlers
from stepstone.api.query_params import checked_query
from stepstone.api.routes import (
    bulk,
    definitions,
    instance_actions,
    instances,
    messages,
    meta,
    operator_queries,
    outbox,
    retention,
    tasks,
)

__all__ = ["API_PREFIX", "ROUTERS", "create_app"]

API_PREFIX = "/api/v1"
ROUTERS: list[APIRouter] = [
    meta.router, instances.router, instance_actions.router, outbox.router, definitions.router, tasks.router,
    messages.router, bulk.router, retention.router, operator_queries.router,
]
"""Every API router; a feature's module adds its own here (tasks, retention, bulk actions, ...)."""


def create_app(ctx: ApiContext, *, ui: bool = True) -> FastAPI:
    """The management app; `ui` False serves the API alone."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await ctx.close()

    app = FastAPI(
        title="stepstone management API", version=version("stepstone"), lifespan=lifespan,
        openapi_url=f"{API_PREFIX}/openapi.json", docs_url=f"{API_PREFIX}/docs", redoc_url=None,
        description="Inspect and steer stepstone workflow instances. Authenticate with "
                    "`Authorization: Bearer <token>` (`stepstone tokens create`). Errors are problem+json.",
    )
    app.state.stepstone = ctx
    install_problem_handlers(app)
    app.add_middleware(BodyGuard)  # bodies bounded, and the token checked before one is read (docs/api.md)
    # An unknown query parameter is refused rather than ignored, and one that takes one value refuses a
    # repeat rather than keep its last (api/query_params.py).
    api = APIRouter(prefix=API_PREFIX, responses=_COMMON_RESPONSES, dependencies=[checked_query])
    for router in ROUTERS:
        api.include_router(router)
    app.include_router(api)
    if ui:
        from stepstone.ui.routes import install_ui  # noqa: PLC0415 - the UI (jinja2) only when served

        install_ui(app)

        @app.get("/", include_in_schema=False)
        async def root() -> RedirectResponse:
            return RedirectResponse("ui/", status_code=307)

    answer_head(app)  # HEAD wherever GET, once every route is in
    return app


_PROBLEM: dict[str, Any] = {"content": {"application/problem+json": {}}}
_COMMON_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "A body nested too deeply to parse", **_PROBLEM},
    401: {"description": "No valid token", **_PROBLEM},
    403: {"description": "The token lacks the role in the instance's scope", **_PROBLEM},
    404: {"description": "Not found, or in a scope the token cannot see", **_PROBLEM},
    405: {"description": "The server is read-only", **_PROBLEM},
    409: {"description": "Conflicts with what is stored (e.g. retry of a running instance)", **_PROBLEM},
    413: {"description": "A request body over the limit (BodyTooLarge)", **_PROBLEM},
    422: {"description": "Invalid input (a body that is not JSON or not UTF-8 too)", **_PROBLEM},
    500: {"description": "A bug; the server log has the details", **_PROBLEM},
    503: {"description": "The database is unavailable (or another transient error): try again", **_PROBLEM},
}
