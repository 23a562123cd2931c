"""The testing kit's engine leaves the database clock as it found it: `advance` moves it for every
session of the database, so a test on a database that outlives it must not leave it days ahead."""

from __future__ import annotations

import asyncpg
import pytest

from stepstone.examples.orders import registry
from stepstone.store.postgres import PostgresStore
from stepstone.testing import open_engine


async def clock_offset(database_url: str) -> float:
    """The offset as another client of the database sees it."""
    conn = await asyncpg.connect(database_url)
    try:
        return float(await conn.fetchval("SELECT extract(epoch FROM offset_by) FROM stepstone.clock"))
    finally:
        await conn.close()


async def test_closing_the_engine_puts_the_clock_back(database_url: str) -> None:
    async with open_engine(database_url, registry) as engine:
        await engine.advance(days=3)
        assert await clock_offset(database_url) > 2 * 86_400  # three days, less the real time the calls took
    assert await clock_offset(database_url) == 0


async def a_failing_test(database_url: str) -> None:
    async with open_engine(database_url, registry) as engine:
        await engine.advance(days=1)
        raise LookupError("the test failed")


async def test_the_engine_restores_the_offset_it_found_even_after_a_failure(database_url: str) -> None:
    store = await PostgresStore.open(database_url)
    try:
        await store.move_clock(600)
    finally:
        await store.close()
    with pytest.raises(LookupError):
        await a_failing_test(database_url)
    assert await clock_offset(database_url) == 600


async def test_the_clock_is_put_back_after_the_test_closed_its_client(database_url: str) -> None:
    # Closing the client closes the engine's store: the offset is written back through a store of its own
    # (the first version of the restore failed the teardown of every test that closed its client).
    async with open_engine(database_url, registry) as engine:
        await engine.move_clock(hours=5)
        await engine.client.close()
    assert await clock_offset(database_url) == 0
