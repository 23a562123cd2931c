"""Fixtures of the engine tests: an engine on a fresh database and raw row access."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest

from stepstone.testing import Engine, open_engine
from tests.engine import workflows


@pytest.fixture(autouse=True)
def _clean_steering() -> Iterator[None]:
    workflows.FAILURES.clear()
    workflows.HOLD.clear()
    yield
    for hold in workflows.HOLD.values():
        hold.release.set()
    workflows.FAILURES.clear()
    workflows.HOLD.clear()


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, workflows.registry, concurrency=4, lease_seconds=30, max_claims=3) as e:
        yield e


class Rows:
    """Read the engine's tables directly (one connection), for assertions about what is stored."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def dump(self) -> dict[str, list[tuple[Any, ...]]]:
        """Every row of every engine table, in a stable order."""
        out: dict[str, list[tuple[Any, ...]]] = {}
        for table, order in (
            ("instances", "id"), ("positions", "instance_id, path"), ("commands", "id"),
            ("history", "instance_id, seq"),
            ("outbox", "id"), ("dedup", "kind, namespace, key"),
        ):
            rows = await self.conn.fetch(f"SELECT * FROM stepstone.{table} ORDER BY {order}")
            out[table] = [tuple(r.values()) for r in rows]
        return out

    async def commands(self, instance_id: str | None = None) -> list[asyncpg.Record]:
        if instance_id is None:
            return await self.conn.fetch("SELECT * FROM stepstone.commands ORDER BY id")
        return await self.conn.fetch(
            "SELECT * FROM stepstone.commands WHERE instance_id = $1::uuid ORDER BY id", instance_id
        )

    async def count(self, sql: str, *args: Any) -> int:
        return int(await self.conn.fetchval(sql, *args))

    async def open_commands(self, instance_id: str | None = None) -> list[asyncpg.Record]:
        """Commands still PENDING, DEFERRED, CLAIMED or PARKED."""
        return [
            c for c in await self.commands(instance_id)
            if c["state"] in ("PENDING", "DEFERRED", "CLAIMED", "PARKED")
        ]


@pytest.fixture
async def rows(database_url: str) -> AsyncIterator[Rows]:
    conn = await asyncpg.connect(database_url)
    try:
        yield Rows(conn)
    finally:
        await conn.close()


def kinds(history: list[dict[str, Any]]) -> list[str]:
    return [h["kind"] for h in history]
