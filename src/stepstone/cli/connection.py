"""Opening the store for a command: the configured or embedded database, schema checked first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, cast

from stepstone.cli.common import CliError
from stepstone.config import Settings
from stepstone.store import migrate as migrations
from stepstone.store.database import redact_url, resolve_target
from stepstone.store.postgres import PostgresStore

if TYPE_CHECKING:
    import asyncpg

__all__ = ["check_schema", "open_store"]


async def check_schema(store: PostgresStore) -> None:
    """A one-line CliError unless the schema is exactly at the shipped version (migrates nothing)."""
    async with store.pool.acquire() as conn:
        state = await migrations.status(cast("asyncpg.Connection", conn), store.schema)
    where = f"schema {store.schema!r} in {redact_url(store.url)}"
    if state.current_version is None:
        raise CliError(f"{where} is not set up: run `stepstone db migrate` first")
    if state.unknown:
        raise CliError(f"{where} is newer than this stepstone (versions {state.unknown}): upgrade stepstone")
    if state.pending:
        raise CliError(f"{where} has {len(state.pending)} pending migration(s): run `stepstone db migrate`")


@asynccontextmanager
async def open_store(settings: Settings, *, pool_size: int = 4, check: bool = True) -> AsyncIterator[PostgresStore]:
    """The store on the configured database (or the embedded default), closed on exit."""
    target = await asyncio.to_thread(resolve_target, settings)
    store = await PostgresStore.open(target.url, settings.schema, max_size=pool_size)
    try:
        if check:
            await check_schema(store)
        yield store
    finally:
        await store.close()
