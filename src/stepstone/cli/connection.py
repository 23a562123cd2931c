"""Opening the store for a command: the configured or embedded database, schema checked first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import click

from stepstone.config import Settings
from stepstone.store import factory
from stepstone.store.database import resolve_target
from stepstone.store.port import Store
from stepstone.store.readiness import ensure_ready

__all__ = ["check_schema", "open_store"]


async def check_schema(store: Store, *, embedded: bool = False) -> None:
    """SchemaNotReady (one line: run `stepstone db migrate`) unless the schema is at the shipped
    version; the embedded default is migrated instead, saying so on stderr."""
    await ensure_ready(store, embedded=embedded, announce=lambda line: click.echo(f"stepstone: {line}", err=True))


@asynccontextmanager
async def open_store(settings: Settings, *, pool_size: int = 4, check: bool = True) -> AsyncIterator[Store]:
    """The store on the configured database (or the embedded default), closed on exit."""
    target = await asyncio.to_thread(resolve_target, settings)
    store = await factory.open_store(target.url, settings.schema, max_size=pool_size)
    try:
        if check:
            await check_schema(store, embedded=target.embedded)
        yield store
    finally:
        await store.close()
