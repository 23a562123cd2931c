"""Forks, joins, branch signals and child workflows end to end on PostgreSQL."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest

from stepstone import Registry, StepContext, Workflow
from stepstone.errors import DefinitionError, PositionNotFound
from stepstone.testing import Engine, open_engine
from tests.engine import branch_workflows as bw
from tests.engine.conftest import Rows, kinds


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, bw.registry, concurrency=4, lease_seconds=30) as e:
        yield e


def steps_completed(history: list[dict[str, object]]) -> Counter[tuple[object, object]]:
    return Counter((h["position"], h["step"]) for h in history if h["kind"] == "STEP_COMPLETED")


async def test_static_fork_runs_every_branch_once_and_joins_once(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(bw.static, {})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info.error
    assert info.state["results"] == {"left_a": 1, "left_b": 2, "right_a:right": 3}
    assert info.state["log"] == ["after:3"]
    history = await engine.client.history(iid)
    assert steps_completed(history) == {
        ("split/left", "left_a"): 1, ("split/left", "left_b"): 1, ("split/right", "right_a"): 1, ("", "after"): 1,
    }
    assert kinds(history).count("JOINED") == 1 and kinds(history).count("BRANCH_JOINED") == 2
    assert {(p["path"], p["status"]) for p in info.positions} == {
        ("", "COMPLETED"), ("split/left", "COMPLETED"), ("split/right", "COMPLETED"),
    }
    assert await rows.count("SELECT branches FROM stepstone.instances WHERE id = $1", iid) == 0
    assert await rows.open_commands(iid) == []


async def test_map_fork_merges_disjoint_changes_of_concurrent_branches(engine: Engine) -> None:
    items = list(range(1, 13))
    iid = await engine.client.start(bw.mapped, {"items": items})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info.error
    assert info.state["results"] == {str(n): v * v for n, v in enumerate(items)}
    assert info.state["counter"] == sum(v * v for v in items)
    history = await engine.client.history(iid)
    assert sum(1 for h in history if h["kind"] == "STEP_COMPLETED" and h["step"] == "square") == len(items)
    assert kinds(history).count("JOINED") == 1


async def test_an_empty_map_goes_straight_past_the_join(engine: Engine) -> None:
    iid = await engine.client.start(bw.mapped, {"items": []})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["counter"] == 0
    assert [p["path"] for p in info.positions] == [""]


@pytest.mark.parametrize(
    ("items", "problem"), [("nope", "holds str, not a list"), (list(range(51)), "the limit is 50")]
)
async def test_a_bad_map_fails_the_instance_clearly(engine: Engine, items: object, problem: str) -> None:
    iid = await engine.client.start(bw.mapped, {"items": items})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED" and info.error["type"] == "InvalidMap" and problem in info.error["message"]
    [start] = await engine.store.pool.fetch(
        "SELECT kind, state, last_error FROM stepstone.commands WHERE instance_id = $1::uuid", iid)
    assert start["state"] == "FAILED" and "InvalidMap" in start["last_error"]


async def test_two_branches_changing_the_same_field_both_land(engine: Engine) -> None:
    bw.BARRIER["overlap"] = threading.Barrier(2)
    try:
        iid = await engine.client.start(bw.overlap, {})
        await engine.run_until_idle()
    finally:
        bw.BARRIER.clear()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info.error
    assert info.state["counter"] == 2, "an update was lost"
    assert sorted(info.state["log"]) == ["bump:a", "bump:b", "finish"]
    # Both read the same state; the later commit was refused and its step ran again on fresh state.
    assert engine.worker.events.conflicts >= 1
    history = await engine.client.history(iid)
    assert steps_completed(history)[("both/a", "bump")] == 1 and steps_completed(history)[("both/b", "bump")] == 1


def _when_committed(engine: Engine, position: str, done: threading.Event) -> None:
    """Set `done` once a commit of `position` has returned (grouped or alone)."""
    for name in ("commit", "commit_many"):
        inner = getattr(engine.store, name)

        async def wrapped(requests: Any, *args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            out = await _inner(requests, *args, **kwargs)
            if any(r.claim.instance.position == position for r in (requests if isinstance(requests, list)
                                                                   else [requests])):
                done.set()
            return out

        setattr(engine.store, name, wrapped)


async def test_a_step_after_a_conflict_whose_re_run_changed_nothing_sees_the_fresh_state(engine: Engine) -> None:
    """The refused branch runs its step again on the current state, changes nothing this time, and goes on
    to its next step in the same segment: that step must see the state the conflict returned, not the
    state the segment was claimed with, or its commit would write the other branch's change away."""
    bw.BARRIER["claim_once"] = threading.Barrier(2)
    bw.A_COMMITTED.clear()
    _when_committed(engine, "both/a", bw.A_COMMITTED)
    try:
        iid = await engine.client.start(bw.claim_once, {})
        await engine.run_until_idle()
    finally:
        bw.BARRIER.clear()
    assert engine.worker.events.conflicts == 1
    await engine.client.signal(iid, "go", position="both/a")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info.error
    assert info.state["results"] == {"owner": 1}, f"an update was lost: {info.state}"
    assert info.state["log"] == ["note"]


async def test_join_any_cancels_the_loser_and_the_ended_instance_takes_no_signal(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(bw.race, {})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info.error
    assert info.state["log"] == ["sprint", "won"]
    assert {p["path"]: p["status"] for p in info.positions}["contest/slow"] == "CANCELLED"
    with pytest.raises(Exception, match="COMPLETED"):
        await engine.client.signal(iid, "go", position="contest/slow")


async def test_a_signal_for_a_cancelled_branch_is_recorded_and_ignored(engine: Engine, rows: Rows) -> None:
    """A live instance whose branch was cancelled: the late callback leaves history, never a step."""
    iid = await engine.client.start(bw.gated, {})
    await engine.run_until_idle()
    # Cancel one branch the way a join cancels its losers, then signal it.
    await engine.store.pool.execute(
        "SELECT stepstone.close_branches($1::uuid, 'gates/g2', 'test', stepstone.db_now(), 'test')", iid)
    await engine.client.signal(iid, "open", "late", position="gates/g2")
    await engine.run_until_idle()
    history = await engine.client.history(iid)
    ignored = [h for h in history if h["kind"] == "CALLBACK_IGNORED"]
    assert len(ignored) == 1 and ignored[0]["position"] == "gates/g2"
    assert all(h["step"] != "passed" for h in history if h["kind"] == "STEP_COMPLETED")


async def test_signals_address_one_branch(engine: Engine) -> None:
    iid = await engine.client.start(bw.gated, {})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "WAITING"
    assert {p["path"]: p["step"] for p in info.positions if p["path"]} == {"gates/g1": "gate", "gates/g2": "gate"}
    with pytest.raises(PositionNotFound):
        await engine.client.signal(iid, "open", 0, position="gates/g9")
    await engine.client.signal(iid, "open", 1, position="gates/g2")
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).state["log"] == ["g2:1"]
    await engine.client.signal(iid, "open", 2, position="gates/g1")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["log"] == ["g2:1", "g1:2", "closed"]


async def test_a_signal_to_the_root_does_not_reach_a_branch(engine: Engine) -> None:
    iid = await engine.client.start(bw.gated, {})
    await engine.run_until_idle()
    await engine.client.signal(iid, "open", 1)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "WAITING" and info.parked_signals == 1


async def test_a_child_runs_and_the_parent_resumes_with_its_result(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(bw.parent, {"n": 4})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info.error
    assert info.state["out"] == 40
    [child] = info.children
    assert child["status"] == "COMPLETED" and child["definition_id"] == "job"
    kid = await engine.client.get(child["id"])
    assert kid.parent_id == iid and kid.state["out"] == 40
    history = kinds(await engine.client.history(iid))
    assert history.count("CHILD_STARTED") == 1 and history.count("CHILD_COMPLETED") == 1
    assert await rows.count("SELECT count(*) FROM stepstone.instances WHERE parent_id = $1::uuid", iid) == 1


async def test_a_failed_child_takes_the_failure_route(engine: Engine) -> None:
    iid = await engine.client.start(bw.parent, {"n": 1, "fail": True})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["out"] == -1
    assert info.children[0]["status"] == "FAILED"


async def test_a_failed_child_without_a_route_fails_the_parent(engine: Engine) -> None:
    iid = await engine.client.start(bw.strict_parent, {"n": 1, "fail": True})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED" and info.error["type"] == "ChildFailed"
    assert "refused" in info.error["message"]


async def test_cancelling_the_parent_cancels_its_child(engine: Engine) -> None:
    iid = await engine.client.start(bw.strict_parent, {"n": 1, "wait": True})
    await engine.run_until_idle()
    [child] = (await engine.client.get(iid)).children
    assert child["status"] == "WAITING"
    assert await engine.client.cancel(iid, "stop") == "CANCELLED"
    assert (await engine.client.get(child["id"])).status == "CANCELLED"
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "CANCELLED"


async def test_an_abandoned_child_outlives_its_cancelled_parent(engine: Engine) -> None:
    iid = await engine.client.start(bw.abandoning, {"n": 1})
    await engine.run_until_idle()
    [child] = (await engine.client.get(iid)).children
    await engine.client.cancel(iid, "stop")
    assert (await engine.client.get(child["id"])).status == "WAITING"
    await engine.client.signal(child["id"], "done")
    await engine.run_until_idle()
    assert (await engine.client.get(child["id"])).status == "COMPLETED"
    history = await engine.client.history(iid)
    assert kinds(history)[-1] == "INSTANCE_CANCELLED"  # the late CHILD_COMPLETION was rejected, not applied


async def test_cancelling_a_child_resumes_the_parent_on_its_failure_route(engine: Engine) -> None:
    iid = await engine.client.start(bw.parent, {"n": 2, "wait": True})
    await engine.run_until_idle()
    [child] = (await engine.client.get(iid)).children
    await engine.client.cancel(child["id"], "operator")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["out"] == -1


def _noop(_: StepContext, __: object) -> None:
    """A handler that does nothing."""


def test_plan_errors_for_forks_and_joins() -> None:
    def build(configure: object) -> str:
        wf: Workflow[dict[str, object]] = Workflow("bad", version=1)
        configure(wf)  # type: ignore[operator]
        with pytest.raises(DefinitionError) as err:
            wf.plan  # noqa: B018
        return str(err.value)

    def lonely_join(wf: Workflow[dict[str, object]]) -> None:
        wf.step(start=True, next="j")(_noop)
        wf.join("j", fork="nowhere", next="x")
        wf.step(name="x", next=None)(_noop)

    def no_branches(wf: Workflow[dict[str, object]]) -> None:
        wf.fork("f", branches={}, start=True)
        wf.join("j", fork="f", next="x")
        wf.step(name="x", next=None)(_noop)

    def never_joins(wf: Workflow[dict[str, object]]) -> None:
        wf.fork("f", branches={"a": "loop"}, start=True)
        wf.step(name="loop", next="loop")(_noop)
        wf.join("j", fork="f", next="x")
        wf.step(name="x", next=None)(_noop)

    def ends_in_branch(wf: Workflow[dict[str, object]]) -> None:
        wf.fork("f", branches={"a": "quit"}, start=True)
        wf.step(name="quit", next=["j", "$end"])(_noop)
        wf.join("j", fork="f", next="x")
        wf.step(name="x", next=None)(_noop)

    assert "join step 'j' names no fork" in build(lonely_join)
    assert "needs either branches or map_over" in build(no_branches)
    assert "can never reach its join" in build(never_joins)
    assert "a branch ends at its join" in build(ends_in_branch)


async def test_a_child_workflow_that_is_not_registered_is_refused_at_start(database_url: str) -> None:
    orphan: Workflow[dict[str, object]] = Workflow("orphan", version=1)

    @orphan.child(workflow="missing", next="x", start=True)
    def spawn(ctx: StepContext, state: dict[str, object]) -> dict[str, object]:
        return {}

    orphan.step(name="x", next=None)(_noop)
    with pytest.raises(DefinitionError, match="orphan v1 starts 'missing'"):
        async with open_engine(database_url, Registry(orphan)):
            pass


async def test_nested_forks_timers_in_branches_and_a_retried_branch(engine: Engine) -> None:
    bw.FLAKY_BRANCH.add("outer/x/inner/q")
    try:
        iid = await engine.client.start(bw.nested, {})
        await engine.run_until_idle()
        info = await engine.client.get(iid)
        assert info.status == "FAILED" and "outer/x/inner/q is down" in info.error["message"]
        paths = {p["path"]: p["status"] for p in info.positions}
        assert paths["outer/x/inner/q"] == "FAILED" and paths["outer/x/inner/p"] == "COMPLETED"
        assert paths["outer/y"] == "WAITING"  # the timer branch waits on, unaffected
    finally:
        bw.FLAKY_BRANCH.clear()
    await engine.client.retry(iid)
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "WAITING"  # the timer branch still sleeps
    await engine.move_clock(61)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info.error
    assert info.state["results"] == {"outer/x/inner/p": 1, "outer/x/inner/q": 1}
    assert info.state["log"] == ["nested done"]
    history = await engine.client.history(iid)
    assert [h["step"] for h in history if h["kind"] == "JOINED"] == ["inner_done", "outer_done"]


async def test_a_fork_entered_again_starts_fresh_branches(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(bw.looping, {})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info.error
    assert info.state["results"] == {"a0": 1, "b0": 1, "a1": 1, "b1": 1, "a2": 1, "b2": 1}
    history = await engine.client.history(iid)
    assert kinds(history).count("JOINED") == 3
    visits = sorted(h["visit"] for h in history if h["kind"] == "STEP_COMPLETED" and h["position"] == "round/a")
    assert len(set(visits)) == 3  # a new visit each round: a fresh idempotency key for each branch step


async def test_run_until_idle_does_not_stop_when_a_segment_ends_during_an_empty_claim(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim whose snapshot predates the commit of a segment that ends while the claim runs finds
    nothing, though that commit queued work (here: the fork's branches). The run must look again."""
    real_claim = engine.store.claim
    worker = engine.worker

    async def stale_claim(*args: object, **kwargs: object) -> list[object]:
        if worker._tasks:
            await asyncio.wait(set(worker._tasks))
            return []  # what a snapshot taken before their commits saw
        return await real_claim(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.store, "claim", stale_claim)
    iid = await engine.client.start(bw.static, {})
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"
