"""Helpers for testing workflows against a real PostgreSQL: an engine in one object,
a movable database clock, and run-until-idle instead of sleeps.

    async with open_engine(database_url, registry) as engine:
        iid = await engine.client.start(order, {...})
        await engine.run_until_idle()
        await engine.advance(timedelta(minutes=5))   # timers fire
        await engine.run_until_idle()
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from stepstone.authoring.workflow import Registry
from stepstone.client import Client
from stepstone.core.limits import Limits
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.factory import open_store
from stepstone.store.port import Store

__all__ = ["Engine", "open_engine"]


@dataclass
class Engine:
    """A store, a client and a worker on one database, for tests."""

    store: Store
    client: Client
    worker: Worker

    async def run_until_idle(self) -> None:
        """Run every command that is claimable now, and whatever they make claimable."""
        await self.worker.run_until_idle()

    async def advance(self, by: timedelta | float) -> datetime:
        """Move the database clock forward for every session; returns the new db time."""
        seconds = by.total_seconds() if isinstance(by, timedelta) else float(by)
        return await self.store.move_clock(seconds)

    def new_worker(self, **config: Any) -> Worker:
        """Another worker on the same store (e.g. to take over an expired lease)."""
        return Worker(self.store, self.worker.registry, WorkerConfig(**config), self.worker.limits)


@asynccontextmanager
async def open_engine(
    database_url: str,
    registry: Registry,
    *,
    schema: str = "stepstone",
    limits: Limits | None = None,
    **config: Any,
) -> AsyncIterator[Engine]:
    """Open an engine on a migrated database; `config` goes to WorkerConfig."""
    store = await open_store(database_url, schema, max_size=config.get("concurrency", 8) + 4)
    client = Client(store, registry, limits=limits)
    try:
        worker = Worker(store, registry, WorkerConfig(**config), limits)
        await worker.register()
        yield Engine(store, client, worker)
    finally:
        await client.detach()
        await store.close()
