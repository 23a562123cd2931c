"""Step deadlines on a branch's first step. A fork opens its branches itself (`open_branches`) rather
than entering their first steps, so an action there once ran with no deadline at all, while the same
step second in a branch, or at the root, was interrupted. Its deadline now counts from the fork."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest
from pydantic import BaseModel, Field

from stepstone import END, Registry, StepContext, Workflow
from stepstone.testing import Engine, open_engine
from tests.sagas.conftest import kinds

HOLD: dict[str, asyncio.Event] = {}
ENTERED: dict[str, asyncio.Event] = {}


class Legs(BaseModel):
    items: list[int] = Field(default_factory=lambda: [7])
    rounds: int = 0
    hold_round: int = 0
    log: list[str] = Field(default_factory=list)


async def slow(ctx: StepContext, state: Legs) -> None:
    """Held in its handler while the test holds the instance (HOLD), in round `hold_round` only."""
    if state.rounds == state.hold_round and ctx.instance_id in HOLD:
        ENTERED[ctx.instance_id].set()
        await HOLD[ctx.instance_id].wait()
    state.log.append("slow")


def late(ctx: StepContext, state: Legs) -> None:
    state.log.append("late")


def quick(ctx: StepContext, state: Legs) -> None:
    state.log.append("quick")


def done(ctx: StepContext, state: Legs) -> None:
    state.log.append("done")


def again(ctx: StepContext, state: Legs) -> str:
    state.rounds += 1
    return "split" if state.rounds < 2 else END  # type: ignore[return-value]


def _forked(name: str, *, on_deadline: str | None, need: str = "all", other: str = "quick") -> Workflow[Legs]:
    """split(a: slow, 5 s deadline; b: `other`) -> meet (`need`) -> done."""
    wf: Workflow[Legs] = Workflow(name, version=1, state=Legs)
    wf.fork("split", branches={"a": "slow", "b": other}, start=True)
    wf.step(slow, name="slow", next="meet", deadline=5, on_deadline=on_deadline)
    if on_deadline:
        wf.step(late, name=on_deadline, next="meet")
    if other == "quick":
        wf.step(quick, name="quick", next="meet")
    else:
        wf.wait(other, signals={"go": "meet"})
    wf.join("meet", fork="split", next="done", need=need)
    wf.step(done, name="done", next=None)
    return wf


timely = _forked("branch_timely", on_deadline="late")
strict = _forked("branch_strict", on_deadline=None)
lenient = _forked("branch_lenient", on_deadline=None, need="any", other="hold")

mapped: Workflow[Legs] = Workflow("branch_mapped", version=1, state=Legs)
mapped.fork("split", map_over="items", branch="slow", start=True)
mapped.step(slow, name="slow", next="meet", deadline=5, on_deadline="late")
mapped.step(late, name="late", next="meet")
mapped.join("meet", fork="split", next="done")
mapped.step(done, name="done", next=None)

looped: Workflow[Legs] = Workflow("branch_looped", version=1, state=Legs)
looped.fork("split", branches={"a": "slow"}, start=True)
looped.step(slow, name="slow", next="meet", deadline=5, on_deadline="late")
looped.step(late, name="late", next="meet")
looped.join("meet", fork="split", next="again")
looped.step(again, name="again", next=["split", END])

kinds_first: Workflow[Legs] = Workflow("branch_kinds", version=1, state=Legs)
kinds_first.fork("split", branches={"a": "slow", "b": "hold", "c": "nap"}, start=True)
kinds_first.step(slow, name="slow", next="meet", deadline=5)
kinds_first.wait("hold", signals={"go": "meet"}, deadline=60)
kinds_first.timer("nap", next="meet", delay=3600, deadline=60)
kinds_first.join("meet", fork="split", next="done")
kinds_first.step(done, name="done", next=None)


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    HOLD.clear()
    ENTERED.clear()
    yield
    for hold in HOLD.values():
        hold.set()


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    registry = Registry(timely, strict, lenient, mapped, looped, kinds_first)
    async with open_engine(database_url, registry, concurrency=4, lease_seconds=30) as e:
        yield e


async def _overrun(engine: Engine, workflow: Workflow[Legs], state: dict[str, Any] | None = None) -> str:
    """Start, hold `slow` in its handler, pass its 5 s deadline and let another worker act on it; then
    release the held handler, whose commit must be refused. Returns the instance id."""
    iid = await engine.client.start(workflow, state or {})
    HOLD[iid], ENTERED[iid] = asyncio.Event(), asyncio.Event()
    held = asyncio.create_task(engine.run_until_idle())
    await ENTERED[iid].wait()
    await engine.move_clock(6)
    await engine.new_worker(concurrency=2, lease_seconds=30).run_until_idle()
    HOLD[iid].set()
    await held
    assert engine.worker.events.fenced == 1
    return iid


def _at(history: list[dict[str, Any]], kind: str) -> list[tuple[str | None, str | None]]:
    return [(h["position"], h["step"]) for h in history if h["kind"] == kind]


async def test_a_branchs_first_step_that_overruns_moves_to_on_deadline(engine: Engine) -> None:
    iid = await _overrun(engine, timely)
    info = await engine.client.get(iid)
    assert (info.status, sorted(info.state["log"])) == ("COMPLETED", ["done", "late", "quick"])
    history = await engine.client.history(iid)
    assert _at(history, "STEP_DEADLINE_EXCEEDED") == [("split/a", "slow")]
    k = kinds(history)
    assert k.index("STEP_DEADLINE_PASSED") < k.index("STEP_DEADLINE_EXCEEDED") < k.index("JOINED")
    [cancelled] = [h for h in history if h["kind"] == "COMMAND_CANCELLED"]
    assert (cancelled["position"], cancelled["data"]["kind"]) == ("split/a", "STEP")  # the late handler's


async def test_a_branchs_first_step_that_overruns_without_on_deadline_fails_the_instance(engine: Engine) -> None:
    iid = await _overrun(engine, strict)  # the join needs both branches: it can no longer be met
    info = await engine.client.get(iid)
    assert info.status == "FAILED"
    assert (info.error["type"], info.error["step"]) == ("StepDeadline", "slow")
    assert "slow" not in info.state["log"]
    history = await engine.client.history(iid)
    assert _at(history, "INSTANCE_FAILED") == [("split/a", "slow")]
    assert "JOINED" not in kinds(history)


async def test_a_failed_branch_first_step_is_passed_over_by_a_join_that_needs_fewer(engine: Engine) -> None:
    iid = await _overrun(engine, lenient)  # b still waits, so a join that needs one can still be met
    history = await engine.client.history(iid)
    assert _at(history, "BRANCH_FAILED") == [("split/a", "slow")]
    assert (await engine.client.get(iid)).status == "WAITING"
    await engine.client.signal(iid, "go", position="split/b")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.state["log"]) == ("COMPLETED", ["done"])


async def test_a_map_branchs_step_takes_its_deadline(engine: Engine) -> None:
    iid = await _overrun(engine, mapped)
    info = await engine.client.get(iid)
    assert (info.status, info.state["log"]) == ("COMPLETED", ["late", "done"])
    assert _at(await engine.client.history(iid), "STEP_DEADLINE_EXCEEDED") == [("split/0", "slow")]


async def test_a_fork_that_runs_again_gives_its_branches_deadlines_again(engine: Engine) -> None:
    """The second round reopens the branch at its next visit (3: the first round was slow at 1, the join
    at 2), which only the store knows: the deadline must name that visit, or it would never match."""
    iid = await _overrun(engine, looped, {"hold_round": 1})
    info = await engine.client.get(iid)
    assert (info.status, info.state["log"]) == ("COMPLETED", ["slow", "late"])
    assert [(h["step"], h["visit"]) for h in await engine.client.history(iid)
            if h["kind"] == "STEP_DEADLINE_EXCEEDED"] == [("slow", 3)]


async def test_every_branch_first_step_gets_one_deadline_timer(engine: Engine, conn: asyncpg.Connection) -> None:
    """An action's is scheduled by the fork's commit, a wait's and a timer's when the branch enters them."""
    iid = await engine.client.start(kinds_first, {})
    await engine.run_until_idle()
    timers = await conn.fetch(
        "SELECT payload, available_at - created_at AS after FROM stepstone.commands WHERE instance_id = $1 "
        "AND kind = 'TIMER' AND name = 'step_deadline' AND position = '$saga' ORDER BY payload->>'position'", iid)
    assert [(json.loads(t["payload"]), t["after"].total_seconds()) for t in timers] == [
        ({"position": "split/a", "step": "slow", "visit": 1}, 5.0),
        ({"position": "split/b", "step": "hold", "visit": 1}, 60.0),
        ({"position": "split/c", "step": "nap", "visit": 1}, 60.0),
    ]
