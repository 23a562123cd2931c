"""A branch whose handler kills its worker's process, and the sibling branches that worker held.

A process that dies (os._exit, a segfault, the OOM killer) leaves every command it held claimed until
its lease runs out. Here a worker "dies" the way such a process does: its segments stop where they are,
nothing is released or recorded, and the database clock moves past the lease. The commands it held are
then run alone, one at a time (runtime/alone.py), and a crash counts on a command only by the claims in
which it ran alone (core/dead_letter.py): the branch that kills the process is the only one
dead-lettered, after its first death and `max_claims` deaths alone, and the siblings complete, with
`max_claims` 1 too (the first death dead-lettered every command the worker held). The suspects run alone
in the order they became claimable again, so the commands given back beside one that then killed its
process run before it does again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from pydantic import BaseModel, Field

from stepstone import Registry, StepContext, Workflow
from stepstone.runtime.worker import Worker
from stepstone.testing import Engine, open_engine
from tests.engine.conftest import Rows

STEER: dict[str, Any] = {}
"""This round's worker, the event its `bad` branch sets on entering, the branches that entered (how many
run side by side in the first round), and in which order they entered."""


class Split(BaseModel):
    log: list[str] = Field(default_factory=list)


def _entered(name: str) -> None:
    STEER["entered"].add(name)
    STEER.setdefault("runs", []).append(name)
    if len(STEER["entered"]) == STEER.get("together", 3):
        STEER["all_in"].set()


async def bad(ctx: StepContext, state: Split) -> None:
    _entered("bad")
    STEER["bad_in"].set()
    await asyncio.Event().wait()  # the process dies here (the test stops the worker)


async def fine(ctx: StepContext, state: Split) -> None:
    """Beside `bad` (all three segments spawned at once) it dies with the process; run alone by its
    worker after the first death, it completes."""
    assert ctx.branch is not None
    _entered(ctx.branch.name)
    worker: Worker = STEER["worker"]
    if not (STEER["later"] and worker.in_flight == 1):
        await asyncio.Event().wait()  # the process dies with it
    state.log.append(ctx.branch.name)


def ended(ctx: StepContext, state: Split) -> None:
    state.log.append("joined")


split: Workflow[Split] = Workflow("crash_split", version=1, state=Split)
split.fork("three", branches={"bad": "bad", "ok1": "fine", "ok2": "fine"}, start=True)
split.step(next="met")(bad)
split.step(next="met")(fine)
split.join("met", fork="three", next="ended")  # all three: bad's dead letter fails the instance
split.step(next=None)(ended)


class Lone(BaseModel):
    name: str


async def lone(ctx: StepContext, state: Lone) -> None:
    """One instance's only step: `bad` kills the process, the others complete when run alone (not beside it)."""
    if state.name == "bad":
        await bad(ctx, Split())
    _entered(state.name)
    worker: Worker = STEER["worker"]
    if not (STEER["later"] and worker.in_flight == 1):
        await asyncio.Event().wait()  # the process dies with it


lone_steps: Workflow[Lone] = Workflow("crash_lone", version=1, state=Lone)
lone_steps.step(next=None, start=True)(lone)
registry = Registry(split, lone_steps)


@pytest.fixture(params=[1, 3], ids=["max_claims_1", "max_claims_3"])
async def engine(database_url: str, request: pytest.FixtureRequest) -> AsyncIterator[Engine]:
    async with open_engine(database_url, registry, concurrency=4, lease_seconds=30, max_claims=request.param) as e:
        yield e
    STEER.clear()


async def _round(engine: Engine, n: int) -> bool:
    """One worker's life: True when it "died" (its `bad` branch ran), False when it ran out of work."""
    max_claims = engine.worker.config.max_claims
    worker = engine.new_worker(concurrency=4, lease_seconds=30, max_claims=max_claims, worker_id=f"w{n}")
    STEER.update(worker=worker, bad_in=asyncio.Event(), all_in=asyncio.Event(), entered=set(), later=n > 1)
    running = asyncio.create_task(worker.run_until_idle())
    died = asyncio.create_task(STEER["bad_in"].wait())
    done, _ = await asyncio.wait({running, died}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    assert done, "the round neither ended nor died"
    if running in done:
        died.cancel()
        running.result()
        return False
    if n == 1:  # the first death takes all three branches, running side by side
        await asyncio.wait_for(STEER["all_in"].wait(), 10)
    # The process dies: every segment stops where it is; nothing is released, noted or committed.
    for task in [running, *worker._tasks]:
        task.cancel()
    await asyncio.gather(running, *worker._tasks, return_exceptions=True)
    await engine.move_clock(31)
    return True


async def test_a_branch_that_kills_its_process_is_dead_lettered_alone(engine: Engine, rows: Rows) -> None:
    max_claims = engine.worker.config.max_claims
    iid = await engine.client.start(split, {})
    deaths = 0
    for n in range(1, 10):
        if not await _round(engine, n):
            break
        deaths += 1
    # One death beside its siblings, then max_claims deaths alone; the next claim dead-letters it. (The
    # siblings run alone in whichever of these rounds claims them first, and complete.)
    assert deaths == max_claims + 1
    info = await engine.client.get(iid)
    assert info.status == "FAILED" and info.error is not None and info.error["type"] == "DeadLetter", info.error
    assert sorted(info.state["log"]) == ["ok1", "ok2"]
    history = [(h["kind"], h["position"]) for h in await engine.client.history(iid)]
    assert ("COMMAND_DEAD_LETTERED", "three/bad") in history
    assert not any(kind == "COMMAND_DEAD_LETTERED" and position != "three/bad" for kind, position in history)
    by_branch = {c["position"].split("/")[-1]: c for c in await rows.commands(iid) if c["position"] != ""}
    assert by_branch["bad"]["state"] == "DEAD" and by_branch["bad"]["claims"] == max_claims + 2
    assert by_branch["ok1"]["state"] == by_branch["ok2"]["state"] == "COMPLETE"
    # The siblings paid for the one death they shared, and no more.
    assert by_branch["ok1"]["claims"] == by_branch["ok2"]["claims"] == 2


async def test_the_commands_given_back_run_alone_before_the_suspect_that_killed_the_process(database_url: str) -> None:
    """Four instances' steps die together; the next worker runs `bad` alone first (all four became claimable
    at once: the oldest command first) and gives the others back, and `bad` kills it. The others were given
    back before `bad`'s lease ran out, so the next worker runs each of them alone before `bad` again. After
    each death the commands table is rewritten in id order (CLUSTER, as VACUUM FULL or a reused page can
    order a heap), where `bad`, started first, comes first: the claim's result had no order, and a small
    table's followed the heap (a large one's puts the expired leases first), so `bad` ran alone at every
    claim and the others waited for its dead letter, `max_claims` deaths later. (The worker's claim takes
    all four here: expired leases are still claimed first, docs/guarantees.md.)"""
    async with open_engine(database_url, registry, concurrency=4, lease_seconds=30, max_claims=3) as engine:
        conn = await asyncpg.connect(database_url)
        try:
            ids = {name: await engine.client.start(lone_steps, {"name": name}) for name in ("bad", "ok1", "ok2", "ok3")}
            STEER["together"] = 4
            deaths = 0
            for n in range(1, 10):
                if not await _round(engine, n):
                    break
                deaths += 1
                await conn.execute("CLUSTER stepstone.commands USING commands_pkey")
            alone = STEER["runs"][4:]  # the first round ran all four side by side
            assert alone[:5] == ["bad", "ok1", "ok2", "ok3", "bad"], alone
            assert deaths == 4  # the first, then max_claims alone; then its dead letter
            for name, iid in ids.items():
                assert (await engine.client.get(iid)).status == ("FAILED" if name == "bad" else "COMPLETED"), name
        finally:
            await conn.close()
            STEER.clear()
