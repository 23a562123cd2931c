"""Fixtures of the saga tests: an engine on a fresh database, with the alert hook recorded."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from stepstone.testing import Engine, open_engine
from tests.sagas import workflows

ALERTS: list[dict[str, Any]] = []


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    for table in (workflows.FAIL, workflows.HOLD, workflows.ENTERED):
        table.clear()
    workflows.CALLS.clear()
    ALERTS.clear()
    yield
    for hold in workflows.HOLD.values():
        hold.set()


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, workflows.registry, concurrency=4, lease_seconds=30, max_claims=3,
                           on_compensation_failed=ALERTS.append) as e:
        yield e


def kinds(history: list[dict[str, Any]]) -> list[str]:
    return [h["kind"] for h in history]


async def assert_ended(engine: Engine, iid: str, status: str, undone: list[str], *in_order: str) -> list[str]:
    """The instance ended `status` with `undone` compensated, its history holding `in_order` in that order."""
    info = await engine.client.get(iid)
    assert (info.status, info.state["undone"]) == (status, undone)
    k = kinds(await engine.client.history(iid))
    assert [k.index(kind) for kind in in_order] == sorted(k.index(kind) for kind in in_order), k
    return k
