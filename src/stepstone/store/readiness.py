"""Is the schema ready for the engine? Checked when a client or a worker opens the store.

A configured database is never migrated implicitly: a missing or behind schema is a typed
`SchemaNotReady` saying to run `stepstone db migrate`. The embedded default is a development database,
so it is migrated on the spot, with one line on the log saying so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from stepstone.errors import SchemaNotReady
from stepstone.store import migrate as migrations
from stepstone.store.dsn import redact_url
from stepstone.store.port import Store

if TYPE_CHECKING:
    import asyncpg

    from stepstone.store.postgres import PostgresStore

__all__ = ["ensure_ready"]

log = logging.getLogger("stepstone.store")


async def ensure_ready(
    store: Store, *, embedded: bool, announce: Callable[[str], None] | None = None
) -> list[migrations.Migration]:
    """Raise unless every shipped migration is applied; on the embedded default, migrate it instead
    and say so in one line through `announce` (default: a warning on the ``stepstone`` log). A schema a
    newer release migrated further is used, with a warning on that log (migrations only add).

    Returns the migrations applied (only ever non-empty when `embedded`).
    """
    pool = cast("PostgresStore", store).pool  # the store package's own adapter (the factory builds no other)
    async with pool.acquire() as pooled:
        conn = cast("asyncpg.Connection", pooled)
        state = await migrations.status(conn, store.schema)
        if state.refused:
            raise migrations.too_new(store.schema, state.unknown)
        if state.usable:
            if state.unknown:
                log.warning("%s", migrations.newer_release(store.schema, state.unknown))
            return []
        if embedded:
            applied = await migrations.migrate(conn, store.schema)
            names = ", ".join(f"{m.version:04d}_{m.name}" for m in applied)
            line = f"migrated the embedded development database (schema {store.schema}): applied {names or 'nothing'}"
            (announce or log.warning)(line)
            return applied
    where = f"schema {store.schema!r} in {redact_url(store.url)}"
    pending = tuple(m.version for m in state.pending)
    if state.current_version is None:
        raise SchemaNotReady(f"{where} is not set up: run `stepstone db migrate` first",
                             schema=store.schema, pending=pending)
    raise SchemaNotReady(f"{where} has {len(pending)} pending migration(s): run `stepstone db migrate` first",
                         schema=store.schema, pending=pending)
