"""Fixtures of the chaos tests: a dedicated PostgreSQL server the rig owns (TCP, restartable).

Where the rig cannot start its server, its tests (partitions, restarts, cuts, lock order, driver logs)
are skipped on a developer machine, but fail in CI (``CI=true``, set by ``.ci/run``): CI must run them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.chaos.rig import server as rig_server


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def rig_unavailable(reason: str) -> None:
    """Skip, or in CI fail, because the rig's server cannot start here."""
    message = f"the chaos rig cannot start its own PostgreSQL here: {reason}"
    if in_ci():
        pytest.fail(f"{message} (CI=true: these tests must run in CI)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def rig_pg() -> Iterator[rig_server.RigServer]:
    reason = rig_server.available()
    if reason:
        rig_unavailable(reason)
    server = rig_server.create_server()
    try:
        yield server
    finally:
        server.destroy()
