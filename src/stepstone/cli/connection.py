"""Opening the store for a command: the configured or embedded database, schema checked first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from stepstone.cli.common import CliError
from stepstone.config import Settings
from stepstone.store import factory
from stepstone.store import migrate as migrations
from stepstone.store.database import connect, redact_url, resolve_target
from stepstone.store.port import Store

__all__ = ["check_schema", "open_store"]


async def check_schema(url: str, schema: str) -> None:
    """A one-line CliError unless the schema is exactly at the shipped version (migrates nothing)."""
    conn = await connect(url)
    try:
        state = await migrations.status(conn, schema)
    finally:
        await conn.close()
    where = f"schema {schema!r} in {redact_url(url)}"
    if state.current_version is None:
        raise CliError(f"{where} is not set up: run `stepstone db migrate` first")
    if state.unknown:
        raise CliError(f"{where} is newer than this stepstone (versions {state.unknown}): upgrade stepstone")
    if state.pending:
        raise CliError(f"{where} has {len(state.pending)} pending migration(s): run `stepstone db migrate`")


@asynccontextmanager
async def open_store(settings: Settings, *, pool_size: int = 4, check: bool = True) -> AsyncIterator[Store]:
    """The store on the configured database (or the embedded default), closed on exit."""
    target = await asyncio.to_thread(resolve_target, settings)
    if check:
        await check_schema(target.url, settings.schema)
    store = await factory.open_store(target.url, settings.schema, max_size=pool_size)
    try:
        yield store
    finally:
        await store.close()
