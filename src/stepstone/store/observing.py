"""Health and metrics reads on the store's pool: the sampled queue figures and the readiness checks."""

from __future__ import annotations

from typing import Any, Protocol, cast, runtime_checkable

import asyncpg

from stepstone.store import migrate as migrations
from stepstone.store.database import translate_errors
from stepstone.store.queries import named_queries
from stepstone.store.registry_port import SERVED_WITHIN_SECONDS

__all__ = ["ObservingQueries", "ObservingStore"]


@runtime_checkable
class ObservingStore(Protocol):
    """What the worker's health endpoints and metrics read (`stepstone.observability`)."""

    async def sample(self) -> dict[str, Any] | None: ...
    async def ping(self) -> None: ...
    async def schema_current(self) -> bool: ...


class ObservingQueries:
    pool: asyncpg.Pool
    url: str
    schema: str

    def _oq(self, name: str) -> str:
        return named_queries("observe.sql", self.schema)[name]

    async def sample(self) -> dict[str, Any] | None:
        """Queue and outbox figures, or None when another worker is sampling right now. Commands routed to a
        plan no worker served within SERVED_WITHIN_SECONDS (the stranded report's rule) are counted apart."""
        with translate_errors(self.url):
            value = await self.pool.fetchval(self._oq("sample"), SERVED_WITHIN_SECONDS)
        return value if isinstance(value, dict) else None

    async def ping(self) -> None:
        with translate_errors(self.url):
            await self.pool.fetchval(self._oq("ping"))

    async def schema_current(self) -> bool:
        """Every shipped migration applied (a newer release's on top count as current: they only add)."""
        with translate_errors(self.url):
            async with self.pool.acquire() as conn:
                state = await migrations.status(cast("asyncpg.Connection", conn), self.schema)
        return state.usable
