"""Building the app on a database: for `stepstone serve` and for a host application that mounts it.

    async with open_app(database_url, registry=registry) as app:
        host.mount("/workflows", app)

`open_app` opens the store (schema checked), the management queries and the outbox on one pool,
and closes them on exit. Pass `authenticate` to map the host's own user to a stepstone `Principal`
instead of API tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

from fastapi import FastAPI
from starlette.requests import Request

from stepstone.api.app import create_app
from stepstone.api.auth import Authenticate, NotLocal, Principal, TokenAuth, local_admin
from stepstone.api.binding import is_loopback
from stepstone.api.context import ApiContext
from stepstone.api.live import Broadcaster
from stepstone.authoring.documents import Catalog
from stepstone.authoring.workflow import Registry
from stepstone.config import Settings
from stepstone.store.factory import open_ready_store
from stepstone.store.management import open_management
from stepstone.store.outbox import PostgresOutbox
from stepstone.store.port import Store

__all__ = ["NO_AUTH", "check_local", "context_on", "open_app"]

UI_PATH = "/ui"  # the UI posts forms (with CSRF values); stepstone.ui.render.UI_PREFIX, which imports this package


async def NO_AUTH(request: Request) -> Principal | None:  # noqa: N802 - a constant-like hook
    """Every request is the local admin: `stepstone serve --no-auth`, on a loopback address only. So
    that a web page the user visits cannot act as that admin, a request must name this server by a
    loopback Host (DNS rebinding names another), and a state change must come from no other origin
    and, to the API, be JSON (a cross-site form or simple request is neither)."""
    check_local(request)
    return local_admin()


_SAFE = frozenset({"GET", "HEAD", "OPTIONS"})


def check_local(request: Request) -> None:
    """NotLocal unless the request is one this loopback server's own pages or a local program send."""
    host = request.headers.get("host", "")
    try:
        named = urlsplit(f"//{host}")
        port = named.port or (443 if request.url.scheme == "https" else 80)
    except ValueError:
        named, port = urlsplit("//"), 0
    server = request.scope.get("server")
    if not named.hostname or not is_loopback(named.hostname) or (server and server[1] != port):
        raise NotLocal(f"this server runs without authentication and answers only requests to its own "
                       f"loopback address (localhost, 127.0.0.1 or [::1] with its port), not Host {host[:100]!r}")
    if request.method in _SAFE:
        return
    origin = request.headers.get("origin")
    if origin is not None and origin != f"{request.url.scheme}://{host}":
        raise NotLocal(f"this server runs without authentication and refuses a {request.method} sent from "
                       f"another site (Origin {origin[:100]!r})")
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    path = request.url.path.removeprefix(request.scope.get("root_path", ""))
    if media and media != "application/json" and not path.startswith(f"{UI_PATH}/"):
        raise NotLocal(f"this server runs without authentication and takes a {request.method} to its API "
                       f"as application/json only, not {media[:100]!r}")


def context_on(
    store: Store, *, registry: Registry | None = None, authenticate: Authenticate | None = None,
    read_only: bool = False, catalog: Catalog | None = None,
) -> ApiContext:
    """The app's parts on an open store: token auth unless `authenticate` is given."""
    management = open_management(store)
    api_auth = authenticate or TokenAuth(management, cookie=False)
    ui_auth = authenticate or TokenAuth(management, cookie=True)
    return ApiContext(store=store, management=management, authenticate=api_auth, authenticate_ui=ui_auth,
                      outbox=PostgresOutbox(store), registry=registry or Registry(), read_only=read_only,
                      broadcaster=Broadcaster(store), catalog=catalog)


@asynccontextmanager
async def open_app(
    database_url: str | None = None, *, schema: str | None = None, settings: Settings | None = None,
    registry: Registry | None = None, authenticate: Authenticate | None = None, read_only: bool = False,
    ui: bool = True, pool_size: int = 10, catalog: Catalog | None = None,
) -> AsyncIterator[FastAPI]:
    store = await open_ready_store(database_url, schema, settings=settings, max_size=pool_size)
    ctx = context_on(store, registry=registry, authenticate=authenticate, read_only=read_only, catalog=catalog)
    try:
        yield create_app(ctx, ui=ui)
    finally:
        await ctx.close()
        await store.close()
