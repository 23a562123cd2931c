"""Retrying a parent whose child step's child has already ended: the step runs again at the same visit, so
it names the same child, which is not started twice; the parent is told that child's end at once instead
of waiting for a report that will never come (docs/branches.md, "Child workflows")."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from stepstone.core.transitions import child_id
from stepstone.testing import Engine, open_engine
from tests.engine import branch_workflows as bw
from tests.engine.conftest import Rows, kinds


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, bw.registry, concurrency=4, lease_seconds=30) as e:
        yield e


@pytest.fixture(autouse=True)
def _steady_jobs() -> Iterator[None]:
    bw.FLAKY_JOBS.clear()
    bw.PARKED_JOBS.clear()
    yield
    bw.FLAKY_JOBS.clear()
    bw.PARKED_JOBS.clear()


async def test_a_parent_retried_while_its_child_is_failed_fails_again_at_once(engine: Engine, rows: Rows) -> None:
    bw.FLAKY_JOBS.add(7)
    iid = await engine.client.start(bw.strict_parent, {"n": 7})
    await engine.run_until_idle()
    cid = child_id(iid, "", "spawn_strict", 1)
    assert (await engine.client.get(iid)).status == "FAILED"
    assert (await engine.client.get(cid)).status == "FAILED"

    await engine.client.retry(iid)  # the child is still FAILED: the parent must not wait for it
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED", info.positions
    assert info.error["type"] == "ChildFailed"
    assert f"child {cid} ended FAILED" in info.error["message"]
    assert "retry the child first" in info.error["message"] and "job 7 refused" in info.error["message"]
    assert kinds(await engine.client.history(iid)).count("CHILD_FAILED") == 2

    bw.FLAKY_JOBS.clear()
    await engine.client.retry(cid)  # its report to the FAILED parent is ignored
    await engine.run_until_idle()
    assert (await engine.client.get(cid)).status == "COMPLETED"
    assert (await engine.client.get(iid)).status == "FAILED"

    await engine.client.retry(iid)  # now the parent hears the child completed, with its final state
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info.error
    assert info.state["out"] == 70
    assert await rows.count("SELECT count(*) FROM stepstone.instances WHERE parent_id = $1::uuid", iid) == 1


async def test_a_parent_retried_after_its_child_was_retried_to_completion_goes_on(engine: Engine) -> None:
    bw.FLAKY_JOBS.add(3)
    iid = await engine.client.start(bw.strict_parent, {"n": 3})
    await engine.run_until_idle()
    cid = child_id(iid, "", "spawn_strict", 1)
    bw.FLAKY_JOBS.clear()
    await engine.client.retry(cid)
    await engine.run_until_idle()
    assert (await engine.client.get(cid)).status == "COMPLETED"
    assert "CALLBACK_IGNORED" in kinds(await engine.client.history(iid))

    await engine.client.retry(iid)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info.error
    assert info.state["out"] == 30


async def test_branches_retried_after_their_children_failed_hear_of_them_at_once(engine: Engine) -> None:
    bw.FLAKY_JOBS.update({10, 11})
    iid = await engine.client.start(bw.fan_jobs, {"counter": 10})
    await engine.run_until_idle()
    kids = {child_id(iid, f"fan/{b}", f"job_{b}", 1): b for b in "xy"}
    info = await engine.client.get(iid)
    assert info.status == "FAILED"
    assert {p["path"]: p["status"] for p in info.positions if p["path"]} == {"fan/x": "FAILED", "fan/y": "FAILED"}
    assert {c["id"] for c in info.children} == set(kids)

    await engine.client.retry(iid)  # both children are still FAILED: both branches fail again at once
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED", info.positions
    assert {p["path"]: p["status"] for p in info.positions if p["path"]} == {"fan/x": "FAILED", "fan/y": "FAILED"}

    bw.FLAKY_JOBS.clear()
    for cid in kids:
        await engine.client.retry(cid)
    await engine.run_until_idle()
    assert [(await engine.client.get(cid)).status for cid in kids] == ["COMPLETED", "COMPLETED"]

    await engine.client.retry(iid)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info.error
    assert info.state["results"] == {"x": 100, "y": 110}
    assert len(info.children) == 2


async def test_a_retried_instance_waits_for_a_child_still_running_and_hears_it_once(engine: Engine) -> None:
    """Only the failed branch runs its child step again; the other branch's child has not ended and reports
    when it does, as before: one report each, none ignored."""
    bw.FLAKY_JOBS.add(20)
    bw.PARKED_JOBS.add(21)
    iid = await engine.client.start(bw.fan_jobs, {"counter": 20})
    await engine.run_until_idle()
    x, y = (child_id(iid, f"fan/{b}", f"job_{b}", 1) for b in "xy")
    assert (await engine.client.get(iid)).status == "FAILED"
    assert [(await engine.client.get(cid)).status for cid in (x, y)] == ["FAILED", "WAITING"]

    bw.FLAKY_JOBS.clear()
    await engine.client.retry(x)
    await engine.run_until_idle()
    await engine.client.retry(iid)  # x hears its child completed at once; y still waits for its own
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "WAITING" and info.state["results"] == {"x": 200}

    await engine.client.signal(y, "done")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info.error
    assert info.state["results"] == {"x": 200, "y": 210}
    history = [h for h in await engine.client.history(iid) if h["kind"] in ("CHILD_COMPLETED", "CALLBACK_IGNORED")]
    # x's first report reached the FAILED instance and was ignored; after the retry one report each
    assert [(h["kind"], h["position"]) for h in history] == [
        ("CALLBACK_IGNORED", "fan/x"), ("CHILD_COMPLETED", "fan/x"), ("CHILD_COMPLETED", "fan/y"),
    ]
