"""The one place the store adapter is built: `open_store` returns the port, never the adapter's type.

The client and `stepstone.testing` open their store here; the runtime is handed one. The import
contracts (pyproject.toml, `lint-imports`) allow the adapter and the driver behind this module only.
"""

from __future__ import annotations

import asyncio

from stepstone.config import DEFAULT_SCHEMA, Settings
from stepstone.store.database import resolve_target
from stepstone.store.port import Store
from stepstone.store.postgres import PostgresStore

__all__ = ["open_store"]


async def open_store(
    database_url: str | None = None,
    schema: str = DEFAULT_SCHEMA,
    *,
    settings: Settings | None = None,
    max_size: int = 10,
) -> Store:
    """The store on `database_url`, or on the configured / embedded database when it is None.

    With no URL, `settings` (or the defaults for `schema`) decide, and their schema wins.
    """
    if database_url is None:
        settings = settings or Settings(database_url=None, schema=schema)
        target = await asyncio.to_thread(resolve_target, settings)
        database_url, schema = target.url, settings.schema
    return await PostgresStore.open(database_url, schema, max_size=max_size)
