"""Fixtures of the runtime hardening tests: their own workflows, steered per test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from stepstone.testing import Engine, open_engine
from tests.engine.hardening import workflows as hw


@pytest.fixture(autouse=True)
def _steering() -> Iterator[None]:
    hw.steer_reset()
    yield
    hw.steer_reset()


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, hw.registry, concurrency=4, lease_seconds=30, max_claims=3) as e:
        yield e
