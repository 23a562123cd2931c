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

from fastapi import FastAPI
from starlette.requests import Request

from stepstone.api.app import create_app
from stepstone.api.auth import Authenticate, Principal, TokenAuth, local_admin
from stepstone.api.context import ApiContext
from stepstone.api.live import Broadcaster
from stepstone.authoring.workflow import Registry
from stepstone.config import Settings
from stepstone.store.factory import open_ready_store
from stepstone.store.management import open_management
from stepstone.store.outbox import PostgresOutbox
from stepstone.store.port import Store

__all__ = ["NO_AUTH", "context_on", "open_app"]


async def NO_AUTH(_request: Request) -> Principal | None:  # noqa: N802 - a constant-like hook
    """Every request is the local admin: `stepstone serve --no-auth`, on a loopback address only."""
    return local_admin()


def context_on(
    store: Store, *, registry: Registry | None = None, authenticate: Authenticate | None = None,
    read_only: bool = False,
) -> ApiContext:
    """The app's parts on an open store: token auth unless `authenticate` is given."""
    management = open_management(store)
    api_auth = authenticate or TokenAuth(management, cookie=False)
    ui_auth = authenticate or TokenAuth(management, cookie=True)
    return ApiContext(store=store, management=management, authenticate=api_auth, authenticate_ui=ui_auth,
                      outbox=PostgresOutbox(store), registry=registry or Registry(), read_only=read_only,
                      broadcaster=Broadcaster(store))


@asynccontextmanager
async def open_app(
    database_url: str | None = None, *, schema: str | None = None, settings: Settings | None = None,
    registry: Registry | None = None, authenticate: Authenticate | None = None, read_only: bool = False,
    ui: bool = True, pool_size: int = 10,
) -> AsyncIterator[FastAPI]:
    store = await open_ready_store(database_url, schema, settings=settings, max_size=pool_size)
    ctx = context_on(store, registry=registry, authenticate=authenticate, read_only=read_only)
    try:
        yield create_app(ctx, ui=ui)
    finally:
        await ctx.close()
        await store.close()
