"""Retrying a parent whose child step's child has already ended: the step runs again at the same visit, so
it names the same child, which is not started twice; the parent is told that child's end at once instead
of waiting for a report that will never come (docs/branches.md, "Child workflows")."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from stepstone import Registry, Workflow
from stepstone.core.transitions import child_id
from stepstone.errors import ChildNotAwaited, InvalidState
from stepstone.ops import Operations
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


# A retry of a FAILED child goes on only while its parent awaits it (docs/operations.md, "Children and
# replay"): a parent that went on to its child step's on_failure and completed takes no result of it, so the
# retry is refused and changes nothing; a child started with cancel_with_parent=False whose parent was
# cancelled at that step was abandoned, and is retried as an instance of its own.


async def test_a_child_whose_parent_took_on_failure_and_completed_is_not_retried(engine: Engine, rows: Rows) -> None:
    bw.FLAKY_JOBS.add(4)
    iid = await engine.client.start(bw.parent, {"n": 4})
    await engine.run_until_idle()
    cid = child_id(iid, "", "spawn", 1)
    assert ((await engine.client.get(iid)).status, (await engine.client.get(iid)).state["out"]) == ("COMPLETED", -1)
    bw.FLAKY_JOBS.clear()
    history = await engine.client.history(cid)

    with pytest.raises(ChildNotAwaited) as refused:
        await engine.client.retry(cid)
    assert str(refused.value).startswith(
        f"instance {cid} is not retried: its parent {iid} has ended (COMPLETED), so nothing takes this child's "
        "result")
    assert str(refused.value).endswith(f"stepstone replay --instance {cid} --from work")
    await engine.run_until_idle()
    assert (await engine.client.get(cid)).status == "FAILED"
    assert await engine.client.history(cid) == history
    assert await rows.count("SELECT count(*) FROM stepstone.commands WHERE instance_id = $1::uuid "
                            "AND kind = 'RETRY'", cid) == 0


async def test_an_abandoned_child_of_a_cancelled_parent_is_retried_as_its_own(engine: Engine) -> None:
    bw.FLAKY_JOBS.add(5)
    iid = await engine.client.start(bw.abandoning, {"n": 5})
    await engine.run_until_idle()
    cid = child_id(iid, "", "spawn_free", 1)
    assert ((await engine.client.get(iid)).status, (await engine.client.get(cid)).status) == ("FAILED", "FAILED")
    await engine.client.cancel(iid)  # the child, started with cancel_with_parent=False, is left as it is
    assert ((await engine.client.get(iid)).status, (await engine.client.get(cid)).status) == ("CANCELLED", "FAILED")
    bw.FLAKY_JOBS.clear()

    await engine.client.retry(cid)
    await engine.run_until_idle()
    assert (await engine.client.get(cid)).status == "WAITING"  # its job runs on, parked for its signal
    assert (await engine.client.get(iid)).status == "CANCELLED"
    assert "CHILD_COMPLETED" not in kinds(await engine.client.history(iid))


async def test_a_replay_of_a_parent_whose_branch_awaits_a_running_child_is_refused(engine: Engine) -> None:
    """Branch x's child failed, which failed the instance; branch y still awaits its child, which waits for
    its signal. A replay would leave that child running for a result nothing takes: refused, nothing changed,
    until the child is cancelled."""
    bw.FLAKY_JOBS.add(0)
    bw.PARKED_JOBS.add(1)
    iid = await engine.client.start(bw.fan_jobs, {})
    await engine.run_until_idle()
    kids = {c["position"]: str(c["id"]) for c in (await engine.client.get(iid)).children}
    assert (await engine.client.get(iid)).status == "FAILED"
    assert [(await engine.client.get(kids[p])).status for p in sorted(kids)] == ["FAILED", "WAITING"]
    [waiting] = [p for p in kids if p.endswith("y")]
    history = await engine.client.history(iid)

    with pytest.raises(InvalidState) as refused:
        await engine.client.replay(iid, "fan")
    assert str(refused.value).startswith(
        f"instance {iid} is not replayed: it still awaits its child {kids[waiting]} (job, WAITING, in branch "
        f"{waiting}), which has not ended;")
    assert await engine.client.history(iid) == history

    await engine.client.cancel(kids[waiting])
    bw.FLAKY_JOBS.clear()
    bw.PARKED_JOBS.clear()
    assert (await engine.client.replay(iid, "fan")).visit > 1
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"


# A retry of a FAILED child whose failure report its parent has not applied yet (queued, or being applied by
# the parent's worker) is refused and changes nothing: applied, the report may take the parent past the child
# (to on_failure, into compensation), and the retried child would run for a result nothing takes. Once the
# parent has applied it, the retry is decided as above (docs/operations.md, "Children and replay").


async def _failed_with_its_report_queued(engine: Engine, database_url: str, workflow: Workflow[bw.Job], n: int,
                                         rows: Rows) -> tuple[str, str]:
    """The parent waits for its child; the child fails, on a worker that serves only the child's workflow, so
    the failure report waits at the parent unapplied."""
    bw.FLAKY_JOBS.add(n)
    iid = await engine.client.start(workflow, {"n": n})
    await engine.run_until_idle()
    [cid] = [str(c["id"]) for c in (await engine.client.get(iid)).children]
    async with open_engine(database_url, Registry(bw.late_job), concurrency=2, lease_seconds=30) as jobs:
        await jobs.client.signal(cid, "go")
        await jobs.run_until_idle()
    assert ((await engine.client.get(iid)).status, (await engine.client.get(cid)).status) == ("WAITING", "FAILED")
    assert await rows.count("SELECT count(*) FROM stepstone.commands WHERE instance_id = $1::uuid "
                            "AND kind = 'CHILD_COMPLETION' AND state IN ('PENDING', 'DEFERRED')", iid) == 1
    bw.FLAKY_JOBS.clear()
    return iid, cid


def _not_yet(cid: str, iid: str) -> str:
    return (f"instance {cid} is not retried: its parent {iid} (WAITING) has not yet applied the report of its "
            "failure, which may take the parent past it (to the child step's on_failure, or into compensation), "
            "and then nothing would take this child's result. Nothing changed. Retry it once the parent has "
            "applied the report: a parent that failed at that step still awaits the child")


async def test_a_child_whose_failure_report_waits_at_its_parent_is_not_retried(
    engine: Engine, database_url: str, rows: Rows,
) -> None:
    iid, cid = await _failed_with_its_report_queued(engine, database_url, bw.late_parent, 8, rows)
    history = await engine.client.history(cid)

    with pytest.raises(InvalidState) as refused:
        await engine.client.retry(cid)
    assert str(refused.value) == _not_yet(cid, iid)
    assert (refused.value.instance_id, refused.value.status) == (cid, "FAILED")
    [item] = (await Operations.on(engine.store).retry([cid])).items
    assert (item.outcome, item.reason) == ("report_pending", _not_yet(cid, iid))
    assert (await engine.client.get(cid)).status == "FAILED"
    assert await engine.client.history(cid) == history
    assert await rows.count("SELECT count(*) FROM stepstone.commands WHERE instance_id = $1::uuid "
                            "AND kind = 'RETRY'", cid) == 0

    await engine.run_until_idle()  # the parent takes the failure: on_failure, and it completes
    info = await engine.client.get(iid)
    assert (info.status, info.state["out"]) == ("COMPLETED", -1)
    with pytest.raises(ChildNotAwaited):
        await engine.client.retry(cid)
    assert await engine.client.history(cid) == history


async def test_a_child_refused_while_its_report_waited_is_retried_once_its_parent_failed_on_it(
    engine: Engine, database_url: str, rows: Rows,
) -> None:
    iid, cid = await _failed_with_its_report_queued(engine, database_url, bw.late_strict, 9, rows)
    with pytest.raises(InvalidState) as refused:
        await engine.client.retry(cid)
    assert str(refused.value) == _not_yet(cid, iid)

    await engine.run_until_idle()  # the parent fails at its child step (ChildFailed): it still awaits the child
    assert (await engine.client.get(iid)).error["type"] == "ChildFailed"
    await engine.client.retry(cid)  # its failed step runs again
    await engine.run_until_idle()
    assert (await engine.client.get(cid)).status == "COMPLETED"
    await engine.client.retry(iid)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.state["out"]) == ("COMPLETED", 90)


async def test_a_child_whose_failure_report_a_dead_worker_of_its_parent_claimed_is_not_retried(
    engine: Engine, database_url: str, rows: Rows,
) -> None:
    """The parent's worker claimed the report and died before its commit: the report is CLAIMED under a lease
    until another worker takes it over, and a retry of the child meanwhile is refused as while it was queued."""
    iid, cid = await _failed_with_its_report_queued(engine, database_url, bw.late_parent, 6, rows)
    [claim] = await engine.store.claim(1, 60, "dead-worker", [bw.late_parent.id])
    assert claim.command.kind == "CHILD_COMPLETION"

    with pytest.raises(InvalidState) as refused:
        await engine.client.retry(cid)
    assert str(refused.value) == _not_yet(cid, iid)
    assert await rows.count("SELECT count(*) FROM stepstone.commands WHERE instance_id = $1::uuid "
                            "AND kind = 'RETRY'", cid) == 0

    await engine.move_clock(seconds=61)  # the dead worker's lease runs out: another worker applies the report
    await engine.run_until_idle()
    assert ((await engine.client.get(iid)).state["out"], (await engine.client.get(cid)).status) == (-1, "FAILED")
    with pytest.raises(ChildNotAwaited):
        await engine.client.retry(cid)
