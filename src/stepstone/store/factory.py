"""The one place the store adapter is built: `open_store` returns the port, never the adapter's type.

The client and `stepstone.testing` open their store here; the runtime is handed one. The import
contracts (pyproject.toml, `lint-imports`) allow the adapter and the driver behind this module only.
"""

from __future__ import annotations

import asyncio
import functools

from stepstone.config import DEFAULT_SCHEMA, Settings, load_settings
from stepstone.store.database import resolve_target
from stepstone.store.database_templates import TemplateDatabases
from stepstone.store.operations_pg import PostgresOperations
from stepstone.store.operations_port import OperationsStore
from stepstone.store.port import Store
from stepstone.store.postgres import PostgresStore
from stepstone.store.readiness import ensure_ready

__all__ = ["TemplateDatabases", "open_ready_store", "open_store", "operations_store"]


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


async def open_ready_store(
    database_url: str | None = None,
    schema: str | None = None,
    *,
    settings: Settings | None = None,
    max_size: int = 10,
) -> Store:
    """The store on `database_url`, or on the configured (flags, environment, pyproject.toml) or
    embedded database, with its schema checked: `SchemaNotReady` unless it is migrated, except on
    the embedded default, which is migrated here, saying so in one line on the log."""
    embedded = False
    if database_url is None:
        if settings is None:
            settings = await asyncio.to_thread(functools.partial(load_settings, schema=schema))
        target = await asyncio.to_thread(resolve_target, settings)
        database_url, schema, embedded = target.url, settings.schema, target.embedded
    store = await PostgresStore.open(database_url, DEFAULT_SCHEMA if schema is None else schema, max_size=max_size)
    try:
        await ensure_ready(store, embedded=embedded)
    except BaseException:
        await store.close()
        raise
    return store


def operations_store(store: object) -> OperationsStore:
    """The operations' port (queries, retention, repair) on a store `open_store` built."""
    return PostgresOperations(store)
