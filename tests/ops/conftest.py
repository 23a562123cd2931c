"""Fixtures of the operations tests: an engine on a fresh database and its operations."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from stepstone.ops import Operations
from stepstone.testing import Engine, open_engine
from tests.ops import workflows


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    workflows.FAILURES.clear()
    yield
    workflows.FAILURES.clear()


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, workflows.registry, concurrency=4, lease_seconds=30) as e:
        yield e


@pytest.fixture
def ops(engine: Engine) -> Operations:
    return Operations.on(engine.store, actor="oncall")
