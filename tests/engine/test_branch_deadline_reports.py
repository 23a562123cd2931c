"""A fork whose branch fails at its step deadline (no `on_deadline`), with the other branches' reports to the
join arriving after the failure, against real PostgreSQL, with no worker killed.

The join needs every branch: the deadline fails the branch and the instance (FAILED), the other branches go
on, and their reports reach the join while the instance is failed. None may be lost or counted twice: after
the retry runs the failed branch again, the join is met with each branch counted once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.testing import Engine, open_engine
from tests.engine.conftest import kinds

RUNS: dict[str, int] = {}
"""How many times each step's handler ran."""

# a waits for `go` with a 60 s deadline and no on_deadline; b and c run a step, then wait for `go`.
forked = Workflow("deadline_fork", version=1)
forked.fork("split", branches={"a": "slow", "b": "quick", "c": "quick"}, start=True)
forked.wait("slow", signals={"go": "meet"}, deadline=60)


@forked.step(next="hold")
async def quick(ctx: StepContext, state: dict[str, Any]) -> None:
    assert ctx.branch is not None
    RUNS[ctx.branch.name] = RUNS.get(ctx.branch.name, 0) + 1


forked.wait("hold", signals={"go": "meet"})
forked.join("meet", fork="split", next="after")


@forked.step(next=None)
async def after(ctx: StepContext, state: dict[str, Any]) -> None:
    RUNS["after"] = RUNS.get("after", 0) + 1


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    RUNS.clear()
    async with open_engine(database_url, Registry(forked), concurrency=2, max_claims=3) as e:
        yield e


async def _reports(conn: asyncpg.Connection, iid: str) -> list[tuple[str, str]]:
    rows = await conn.fetch("SELECT payload->>'branch' AS branch, state FROM stepstone.commands "
                            "WHERE instance_id = $1::uuid AND kind = 'BRANCH_DONE' ORDER BY id", iid)
    return [(r["branch"], r["state"]) for r in rows]


async def _failed_at_as_deadline(engine: Engine) -> str:
    """b and c wait at `hold`; a's deadline passes at `slow`: the branch and the instance FAILED."""
    c = engine.client
    iid = await c.start(forked, {})
    await engine.run_until_idle()
    await engine.move_clock(61)
    await engine.run_until_idle()
    info = await c.get(iid)
    assert info.status == "FAILED" and info.error is not None and info.error["type"] == "StepDeadline", info
    paths = {p["path"]: p["status"] for p in info.positions}
    assert (paths["split/a"], paths["split/b"], paths["split/c"]) == ("FAILED", "WAITING", "WAITING"), paths
    return iid


async def test_reports_arriving_after_a_branch_failed_at_its_deadline_are_counted_once(
    engine: Engine, conn: asyncpg.Connection,
) -> None:
    c = engine.client
    iid = await _failed_at_as_deadline(engine)
    await c.signal(iid, "go", position="split/b")  # b reaches the join while the instance is FAILED
    await engine.run_until_idle()
    info = await c.get(iid)
    [root] = [p for p in info.positions if p["path"] == ""]
    assert info.status == "FAILED" and root["wait"]["done"] == 1, info
    assert await _reports(conn, iid) == [("split/b", "COMPLETE")]
    assert info.parked_signals == 0
    await c.retry(iid)  # a enters its wait again, with a new deadline
    await engine.run_until_idle()
    assert (await c.get(iid)).status == "WAITING"
    await c.signal(iid, "go", position="split/c")  # c reaches the join after the retry
    await c.signal(iid, "go", position="split/a")
    await engine.run_until_idle()
    info = await c.get(iid)
    assert (info.status, RUNS) == ("COMPLETED", {"b": 1, "c": 1, "after": 1}), (info, RUNS)
    assert sorted(await _reports(conn, iid)) == [
        ("split/a", "COMPLETE"), ("split/b", "COMPLETE"), ("split/c", "COMPLETE")]
    history = kinds(await c.history(iid))
    assert (history.count("BRANCH_JOINED"), history.count("JOINED"), history.count("INSTANCE_FAILED")) == (3, 1, 1)


async def test_reports_of_every_other_branch_before_the_retry_are_each_counted_once(
    engine: Engine, conn: asyncpg.Connection,
) -> None:
    """Both other branches report while the instance is failed: the join, short only of a, counts both and
    goes on only once a, run again by the retry, reports too."""
    c = engine.client
    iid = await _failed_at_as_deadline(engine)
    await c.signal(iid, "go", position="split/b")
    await c.signal(iid, "go", position="split/c")
    await engine.run_until_idle()
    info = await c.get(iid)
    [root] = [p for p in info.positions if p["path"] == ""]
    assert (info.status, root["status"], root["wait"]["done"]) == ("FAILED", "WAITING", 2), info
    assert "after" not in RUNS
    await c.retry(iid)
    await engine.run_until_idle()
    await engine.move_clock(61)  # the retried wait has a deadline of its own: it fails again, not the join
    await engine.run_until_idle()
    info = await c.get(iid)
    assert info.status == "FAILED" and "after" not in RUNS, info
    await c.retry(iid)
    await engine.run_until_idle()
    await c.signal(iid, "go", position="split/a")
    await engine.run_until_idle()
    info = await c.get(iid)
    assert (info.status, RUNS) == ("COMPLETED", {"b": 1, "c": 1, "after": 1}), (info, RUNS)
    history = kinds(await c.history(iid))
    assert (history.count("BRANCH_JOINED"), history.count("JOINED"), history.count("STEP_DEADLINE_EXCEEDED")) == (
        3, 1, 2)


# The same wait at the root: the instance fails at its deadline.
root_wait = Workflow("deadline_root_wait", version=1)
root_wait.wait("slow", signals={"go": "after"}, deadline=60, start=True)
root_wait.step(after, name="after", next=None)


async def _deadline_timers(conn: asyncpg.Connection, iid: str) -> int:
    return int(await conn.fetchval(
        "SELECT count(*) FROM stepstone.commands WHERE instance_id = $1::uuid AND kind = 'TIMER' "
        "AND name = 'step_deadline' AND position = '$saga' AND state IN ('PENDING', 'DEFERRED', 'CLAIMED')", iid))


async def test_a_wait_retried_after_its_deadline_gets_one_deadline_timer(
    database_url: str, conn: asyncpg.Connection,
) -> None:
    """The retry queued the wait's deadline anew and its RETRY, entering the wait again, queued a second one:
    both fired, one failed the wait again and the other's TIMER stayed open on it, so after the next retry a
    signal, well within the new deadline, was parked as if it came after the deadline, and never applied."""
    RUNS.clear()
    async with open_engine(database_url, Registry(root_wait), concurrency=2, max_claims=3) as engine:
        c = engine.client
        iid = await c.start(root_wait, {})
        for _ in range(2):  # fail at the deadline, and once more after a retry
            await engine.run_until_idle()
            await engine.move_clock(61)
            await engine.run_until_idle()
            assert (await c.get(iid)).status == "FAILED"
            await c.retry(iid)
            await engine.run_until_idle()
            assert await _deadline_timers(conn, iid) == 1
        await c.signal(iid, "go")
        await engine.run_until_idle()
        info = await c.get(iid)
        assert (info.status, RUNS, info.parked_signals) == ("COMPLETED", {"after": 1}, 0), info
        assert kinds(await c.history(iid)).count("STEP_DEADLINE_EXCEEDED") == 2
