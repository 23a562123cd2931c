"""An engine on the schedule and flow-limit workflows, on a fresh database per test."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import asyncpg
import pytest

from stepstone.testing import Engine, open_engine
from tests.scheduling import workflows


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, workflows.registry, concurrency=8, lease_seconds=30) as e:
        yield e


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    await conn.set_type_codec("jsonb", schema="pg_catalog", encoder=json.dumps, decoder=json.loads)
    try:
        yield conn
    finally:
        await conn.close()
