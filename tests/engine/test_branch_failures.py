"""A branch that fails for good, under joins that need all, some or any of the branches.

The failure stops the instance only when its join can no longer be met without the branch; until
then the other branches go on, the history says BRANCH_FAILED, and the instance is never FAILED.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import BaseModel, Field

from stepstone import Registry, Retry, StepContext, Workflow
from stepstone.errors import ChildNotAwaited
from stepstone.testing import Engine, open_engine
from tests.engine.conftest import kinds

FAILING: set[str] = set()
"""Names of the branches whose step raises (on its only attempt)."""
BARRIER: dict[str, threading.Barrier] = {}


class Vote(BaseModel):
    hold: list[str] = Field(default_factory=list)
    log: list[str] = Field(default_factory=list)


def answer(ctx: StepContext, state: Vote) -> str:
    assert ctx.branch is not None
    name = ctx.branch.name
    barrier = BARRIER.get("vote")
    if barrier is not None and name in FAILING:  # the failing branches run side by side, then both fail
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=10)
    if name in FAILING:
        raise ValueError(f"{name} refused")
    state.log.append(name)
    return "held" if name in state.hold else "agreed"


def done(ctx: StepContext, state: Vote) -> None:
    state.log.append("done")


def _vote(name: str, need: int | str) -> Workflow[Vote]:
    """A fork of branches a, b and c, each answering (or waiting for `go` when listed in `hold`)."""
    wf: Workflow[Vote] = Workflow(name, version=1, state=Vote)
    wf.fork("ask", branches={"a": "answer", "b": "answer", "c": "answer"}, start=True)
    wf.step(next=["agreed", "held"], retry=Retry(max_attempts=1))(answer)
    wf.wait("held", signals={"go": "agreed"})
    wf.join("agreed", fork="ask", next="done", need=need)  # type: ignore[arg-type]
    wf.step(next=None)(done)
    return wf


any_of = _vote("vote_any", "any")
two_of = _vote("vote_two", 2)
all_of = _vote("vote_all", "all")


def inner_vote(ctx: StepContext, state: Vote) -> None:
    assert ctx.branch is not None
    if ctx.branch.name in FAILING:
        raise ValueError(f"{ctx.branch.name} refused")
    state.log.append(ctx.branch.name)


def outer_wait(ctx: StepContext, state: Vote) -> None:
    if "y" in FAILING:
        raise ValueError("y refused")
    state.log.append("y")


def _nested() -> Workflow[Vote]:
    """An outer fork of x (itself a fork of p and q, joined by all) and y (which waits for `go`), joined
    by any: p failing makes x's join impossible, which the outer join does not need."""
    wf: Workflow[Vote] = Workflow("vote_nested", version=1, state=Vote)
    wf.fork("outer", branches={"x": "inner", "y": "outer_wait"}, start=True)
    wf.fork("inner", branches={"p": "inner_vote", "q": "inner_vote"})
    wf.step(next="inner_met", retry=Retry(max_attempts=1))(inner_vote)
    wf.join("inner_met", fork="inner", next="outer_met", need="all")
    wf.step(next="held", retry=Retry(max_attempts=1))(outer_wait)
    wf.wait("held", signals={"go": "outer_met"})
    wf.join("outer_met", fork="outer", next="done", need="any")
    wf.step(next=None)(done)
    return wf


nested = _nested()


class Outer(BaseModel):
    hold: list[str] = Field(default_factory=list)
    outcome: str | None = None


caller: Workflow[Outer] = Workflow("vote_caller", version=1, state=Outer)


@caller.child(workflow="vote_two", next="heard", on_failure="refused", start=True)
def ask_child(ctx: StepContext, state: Outer) -> Vote:
    return Vote(hold=state.hold)


@caller.step(next=None)
def heard(ctx: StepContext, state: Outer) -> None:
    state.outcome = "completed"


@caller.step(next=None)
def refused(ctx: StepContext, state: Outer) -> None:
    assert ctx.child is not None
    state.outcome = f"child {ctx.child.status}"


caller_all: Workflow[Outer] = Workflow("vote_caller_all", version=1, state=Outer)
caller_all.child(workflow="vote_all", next="heard", on_failure="refused", start=True, name="ask_all")(ask_child)
caller_all.step(next=None)(heard)
caller_all.step(next=None)(refused)

brood: Workflow[Vote] = Workflow("vote_brood", version=1, state=Vote)
brood.fork("ask", branches={"k": "ask_child", "h": "held"}, start=True)
brood.child(workflow="vote_all", next="agreed")(ask_child)
brood.wait("held", signals={"go": "agreed"})
brood.join("agreed", fork="ask", next="done", need="any")
brood.step(next=None)(done)

registry = Registry(any_of, two_of, all_of, nested, caller, caller_all, brood)


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    FAILING.clear()
    BARRIER.clear()
    async with open_engine(database_url, registry, concurrency=4, lease_seconds=30) as e:
        yield e
    FAILING.clear()
    BARRIER.clear()


def _positions(info: Any) -> dict[str, str]:
    return {p["path"]: p["status"] for p in info.positions}


async def test_a_join_that_needs_any_passes_over_a_failed_branch(engine: Engine) -> None:
    FAILING.add("a")
    iid = await engine.client.start(any_of, {"hold": ["b", "c"]})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    # a failed, b and c wait: the join can still be met, so the instance waits, it has not failed
    assert info.status == "WAITING" and info.error is None, info
    assert _positions(info)["ask/a"] == "FAILED"
    history = await engine.client.history(iid)
    assert "INSTANCE_FAILED" not in kinds(history)
    [branch_failed] = [h for h in history if h["kind"] == "BRANCH_FAILED"]
    assert branch_failed["position"] == "ask/a" and branch_failed["data"]["type"] == "ValueError"

    await engine.client.signal(iid, "go", {}, position="ask/b")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.error is None, info
    assert sorted(info.state["log"][:2]) == ["b", "c"] and info.state["log"][2:] == ["done"]
    history = await engine.client.history(iid)
    assert "INSTANCE_FAILED" not in kinds(history) and kinds(history).count("JOINED") == 1
    # the join closed the branches it did not need, the failed one among them
    assert _positions(info) == {"": "COMPLETED", "ask/a": "CANCELLED", "ask/b": "COMPLETED", "ask/c": "CANCELLED"}


async def test_a_join_that_can_no_longer_be_met_fails_the_instance(engine: Engine) -> None:
    FAILING.update({"a", "b"})
    iid = await engine.client.start(two_of, {"hold": ["c"]})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED", info
    assert info.error is not None and info.error["type"] == "ValueError"
    history = await engine.client.history(iid)
    # the first failure was passed over (two could still arrive), the second made two impossible
    assert [h["kind"] for h in history if h["kind"] in ("BRANCH_FAILED", "INSTANCE_FAILED")] == [
        "BRANCH_FAILED", "INSTANCE_FAILED"]
    stopped = next(h for h in history if h["kind"] == "INSTANCE_FAILED")
    assert stopped["data"]["message"] == info.error["message"]
    assert {_positions(info)[p] for p in ("ask/a", "ask/b")} == {"FAILED"}

    # An operator's retry runs both failed branches again; now they answer, and the join is met.
    FAILING.clear()
    await engine.client.retry(iid)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.error is None, info
    assert sorted(info.state["log"][:3]) == ["a", "b", "c"] and info.state["log"][3:] == ["done"]


async def test_a_join_that_needs_all_fails_at_the_first_failure(engine: Engine) -> None:
    FAILING.add("a")
    iid = await engine.client.start(all_of, {"hold": ["b", "c"]})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED" and info.error is not None and info.error["message"] == "a refused"
    history = await engine.client.history(iid)
    assert "BRANCH_FAILED" not in kinds(history) and kinds(history).count("INSTANCE_FAILED") == 1


async def test_branches_failing_side_by_side_still_fail_the_instance(engine: Engine) -> None:
    # a and b fail in the same moment, on two slots: each decision alone would think the other still
    # running; the commit counts under the instance's lock, so the second one stops the instance.
    FAILING.update({"a", "b"})
    BARRIER["vote"] = threading.Barrier(2)
    iid = await engine.client.start(two_of, {"hold": ["c"]})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED", info
    history = await engine.client.history(iid)
    assert sorted(h["kind"] for h in history if h["kind"] in ("BRANCH_FAILED", "INSTANCE_FAILED")) == [
        "BRANCH_FAILED", "INSTANCE_FAILED"]


async def test_a_child_whose_join_passes_over_a_failure_completes_for_its_parent(engine: Engine) -> None:
    FAILING.add("a")
    iid = await engine.client.start(caller, {})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["outcome"] == "completed", info
    assert "CHILD_FAILED" not in kinds(await engine.client.history(iid))


async def test_a_child_whose_join_cannot_be_met_fails_for_its_parent(engine: Engine) -> None:
    FAILING.update({"a", "b"})
    iid = await engine.client.start(caller, {})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["outcome"] == "child FAILED", info


async def test_an_inner_join_that_cannot_be_met_counts_as_a_failed_branch_for_the_outer_one(engine: Engine) -> None:
    FAILING.add("p")
    iid = await engine.client.start(nested, {})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "WAITING" and info.error is None, info  # y can still meet the outer join
    history = await engine.client.history(iid)
    assert "INSTANCE_FAILED" not in kinds(history)
    assert [h["position"] for h in history if h["kind"] == "BRANCH_FAILED"] == ["outer/x/inner/p"]
    await engine.client.signal(iid, "go", {}, position="outer/y")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.error is None, info
    assert "INSTANCE_FAILED" not in kinds(await engine.client.history(iid))


async def test_an_inner_failure_that_reaches_the_root_fails_the_instance(engine: Engine) -> None:
    FAILING.update({"p", "y"})  # y's first step fails too: neither outer branch can arrive

    iid = await engine.client.start(nested, {})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED" and info.error is not None, info
    history = await engine.client.history(iid)
    assert kinds(history).count("INSTANCE_FAILED") == 1 and kinds(history).count("BRANCH_FAILED") == 1


async def test_failures_after_the_instance_stopped_are_passed_over(engine: Engine) -> None:
    # All three fail under a join that needs all: the first stops the instance; the others are recorded
    # as branch failures: one INSTANCE_FAILED, the first error kept, the parent told once.
    FAILING.update({"a", "b", "c"})
    iid = await engine.client.start(caller_all, {})
    await engine.run_until_idle()
    parent = await engine.client.get(iid)
    assert parent.status == "COMPLETED" and parent.state["outcome"] == "child FAILED", parent
    [child] = parent.children
    info = await engine.client.get(child["id"])
    history = await engine.client.history(child["id"])
    assert info.status == "FAILED" and kinds(history).count("INSTANCE_FAILED") == 1
    assert kinds(history).count("BRANCH_FAILED") == 2
    stopped = next(h for h in history if h["kind"] == "INSTANCE_FAILED")
    assert info.error is not None and info.error["message"] == stopped["data"]["message"]
    reports = await engine.store.pool.fetchval(
        "SELECT count(*) FROM stepstone.commands WHERE instance_id = $1::uuid AND kind = 'CHILD_COMPLETION'", iid)
    assert reports == 1


async def test_a_failed_child_stays_failed_when_the_join_closes_its_branch(engine: Engine) -> None:
    # Branch k's child fails (its join needs all, and a fails), so k fails; the join needs any and h still
    # waits: k is passed over. When h arrives the join closes k; its child is a record of that failure and
    # stays FAILED (it was CANCELLED, which moved it to retention's completed class).
    FAILING.add("a")
    iid = await engine.client.start(brood, {})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "WAITING" and _positions(info)["ask/k"] == "FAILED", info
    [kid] = info.children
    assert (await engine.client.get(kid["id"])).status == "FAILED"

    await engine.client.signal(iid, "go", {}, position="ask/h")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info
    assert _positions(info)["ask/k"] == "CANCELLED"  # the join closed the branch it did not need
    kid_info = await engine.client.get(kid["id"])
    assert kid_info.status == "FAILED" and kid_info.error is not None and kid_info.error["message"] == "a refused"
    assert "INSTANCE_CANCELLED" not in kinds(await engine.client.history(kid["id"]))


async def test_a_branch_failure_the_join_passes_over_logs_a_warning(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    # a fails and two of three can still arrive: passed over, a WARNING; b fails too and the join can no
    # longer be met: the instance fails, an ERROR. (Each line was an ERROR that said "only if".)
    FAILING.update({"a", "b"})
    caplog.set_level(logging.WARNING, logger="stepstone.worker")
    iid = await engine.client.start(two_of, {"hold": ["c"]})
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "FAILED"
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if iid in r.getMessage()]
    assert len(lines) == 2, lines
    history = await engine.client.history(iid)
    [passed] = [h["position"] for h in history if h["kind"] == "BRANCH_FAILED"]
    [stopped] = [h["position"] for h in history if h["kind"] == "INSTANCE_FAILED"]
    by_position = {message.split("position ")[1].split(" ")[0].strip("'"): (level, message) for level, message in lines}
    assert by_position[passed][0] == logging.WARNING and "its join does not need it" in by_position[passed][1]
    assert by_position[stopped][0] == logging.ERROR and "the instance fails" in by_position[stopped][1]


async def test_a_failed_child_of_a_branch_its_join_passed_over_is_not_retried(engine: Engine) -> None:
    # Branch k failed on its child and the join, which needs any, went on waiting for h: the instance waits and
    # cannot be retried, so nothing takes the child's result (its report would reach the failed branch and be
    # ignored). Its retry is refused, and nothing changes; the instance completes on h as before.
    FAILING.add("a")
    iid = await engine.client.start(brood, {})
    await engine.run_until_idle()
    [kid] = [str(c["id"]) for c in (await engine.client.get(iid)).children]
    FAILING.clear()
    history = await engine.client.history(kid)

    with pytest.raises(ChildNotAwaited) as refused:
        await engine.client.retry(kid)
    assert str(refused.value).startswith(
        f"instance {kid} is not retried: its parent {iid} (WAITING) goes on without the branch that started it "
        "(ask/k, which failed and which its join does not need), so nothing takes this child's result")
    assert ((await engine.client.get(kid)).status, await engine.client.history(kid)) == ("FAILED", history)

    await engine.client.signal(iid, "go", {}, position="ask/h")
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"
    assert "CALLBACK_IGNORED" not in kinds(await engine.client.history(iid))
