"""Fixtures of the chaos tests: a dedicated PostgreSQL server the rig owns (TCP, restartable)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.chaos.rig import server as rig_server


@pytest.fixture(scope="session")
def rig_pg() -> Iterator[rig_server.RigServer]:
    reason = rig_server.available()
    if reason:
        pytest.skip(f"the chaos rig cannot start its own PostgreSQL here: {reason}")
    server = rig_server.create_server()
    try:
        yield server
    finally:
        server.destroy()
