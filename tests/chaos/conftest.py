"""Fixtures of the chaos tests: a dedicated PostgreSQL server the rig owns (TCP, restartable).

Where the rig cannot start its server, its tests (partitions, restarts, cuts, lock order, driver logs)
are skipped on a developer machine, but fail in CI (``CI=true``, set by ``.ci/run``): CI must run them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

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


_HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before tests/conftest.py's hook reads the marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The kill tests (test_*_kills.py here) run in CI's first pass only, as the rig's own kills do
    (test_chaos.py's docstring): what they test, a process dying between its effects and its commit, does
    not change with the server's version, and they were about 75 s of the second pass's CPU."""
    for item in items:
        if item.path.parent == _HERE and item.path.name.endswith("_kills.py"):
            item.add_marker(pytest.mark.first_pass_only)


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
