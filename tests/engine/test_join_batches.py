"""A join takes the branch reports queued behind the one it claimed in the same commit (migration 0037),
on PostgreSQL: every branch joins once, in the order it reported, the join fires once, a join that
needs fewer takes no more than it needs, and the step after the join sees every joined branch's change.

One worker slot makes the queue deterministic: the branches' step commands were queued at the fork, before
any report, so every branch runs before the fork's position claims its first report, and the reports of
all the others are queued behind it by then."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import BaseModel, Field

from stepstone import Registry, StepContext, Workflow
from stepstone.client import Client
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.port import Queued
from stepstone.store.postgres import PostgresStore
from stepstone.testing import Engine, open_engine
from tests.engine.conftest import Rows


class Items(BaseModel):
    items: list[int] = Field(default_factory=list)
    squares: dict[str, int] = Field(default_factory=dict)
    total: int = 0


def _map(name: str, need: int | str | None) -> Workflow[Items]:
    wf: Workflow[Items] = Workflow(name, version=1, state=Items)
    wf.fork("spread", map_over="items", branch="square", start=True)

    @wf.step(next="gather", name="square")
    def square(ctx: StepContext, state: Items) -> None:
        assert ctx.branch is not None
        state.squares[ctx.branch.name] = int(ctx.branch.item) ** 2

    if need is None:
        wf.join("gather", fork="spread", next="add")
    else:
        wf.join("gather", fork="spread", next="add", need=need)

    @wf.step(next=None, name="add")
    def add(_ctx: StepContext, state: Items) -> None:
        state.total = sum(state.squares.values())

    return wf


every = _map("join_batch_all", None)
five = _map("join_batch_five", 5)


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, Registry(every, five), concurrency=1, lease_seconds=30) as e:
        yield e


async def _joins(rows: Rows, iid: str) -> list[tuple[str, int, int]]:
    found = await rows.conn.fetch(
        "SELECT data->>'branch' AS branch, (data->>'done')::int AS done, command_id FROM stepstone.history"
        " WHERE instance_id = $1::uuid AND kind = 'BRANCH_JOINED' ORDER BY seq", iid)
    return [(r["branch"], r["done"], r["command_id"]) for r in found]


async def test_the_queued_reports_join_in_one_commit_each_once(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(every, Items(items=list(range(20))))
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info.error
    assert info.state["total"] == sum(n * n for n in range(20))
    joins = await _joins(rows, iid)
    assert sorted(b for b, _, _ in joins) == sorted(f"spread/{n}" for n in range(20))
    assert [d for _, d, _ in joins] == list(range(1, 21))
    assert len({c for _, _, c in joins}) == 1  # one commit: the claimed report and the 19 behind it
    history = await engine.client.history(iid)
    assert [h["kind"] for h in history].count("JOINED") == 1
    reports = await rows.conn.fetch(
        "SELECT state, claims FROM stepstone.commands WHERE instance_id = $1::uuid AND kind = 'BRANCH_DONE'", iid)
    assert len(reports) == 20 and {r["state"] for r in reports} == {"COMPLETE"}
    assert sorted(r["claims"] for r in reports) == [0] * 19 + [1]


async def test_a_join_that_needs_five_takes_five_and_the_rest_are_left_as_before(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(five, Items(items=list(range(20))))
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info.error
    joins = await _joins(rows, iid)
    assert [d for _, d, _ in joins] == [1, 2, 3, 4, 5] and len({c for _, _, c in joins}) == 1
    assert [h["kind"] for h in await engine.client.history(iid)].count("JOINED") == 1
    states = await rows.conn.fetch(
        "SELECT state, count(*) AS n FROM stepstone.commands WHERE instance_id = $1::uuid AND kind = 'BRANCH_DONE'"
        " GROUP BY state", iid)
    # The instance ended at `add`, which rejected the reports the join did not need.
    assert {r["state"]: r["n"] for r in states} == {"COMPLETE": 5, "REJECTED": 15}


RELEASE: dict[str, asyncio.Event] = {}

held: Workflow[Items] = Workflow("join_batch_held", version=1, state=Items)
held.fork("spread", map_over="items", branch="slow_square", start=True)


@held.step(next="gather", name="slow_square")
async def slow_square(ctx: StepContext, state: Items) -> None:
    assert ctx.branch is not None
    if ctx.branch.item != 1:  # every branch but the first waits for the test
        await RELEASE["branches"].wait()
    state.squares[ctx.branch.name] = int(ctx.branch.item) ** 2


held.join("gather", fork="spread", next="add_held")


@held.step(next=None, name="add_held")
def add_held(_ctx: StepContext, state: Items) -> None:
    state.total = sum(state.squares.values())


class PausingStore(PostgresStore):
    """Holds the first read of the reports queued behind a claimed one until the test says go: by then
    that claim has read the state, and the other branches commit their changes and reports meanwhile."""

    paused: asyncio.Event
    go: asyncio.Event

    async def queued_behind(self, *args: Any) -> Queued:
        if not self.go.is_set():
            self.paused.set()
            await self.go.wait()
        return await super().queued_behind(*args)


async def test_the_step_after_the_join_sees_what_the_joined_branches_wrote(database_url: str, rows: Rows) -> None:
    RELEASE["branches"] = asyncio.Event()
    store = await PausingStore.open(database_url, max_size=8)
    store.paused, store.go = asyncio.Event(), asyncio.Event()
    worker = Worker(store, Registry(held), WorkerConfig(concurrency=4, worker_id="join-held"))
    client = Client(store, Registry(held))
    await worker.start()
    try:
        iid = await client.start(held, Items(items=[1, 2, 3]))
        await asyncio.wait_for(store.paused.wait(), 30)  # the first branch's report claimed, the state read
        committed = worker.events.commits
        RELEASE["branches"].set()
        # The two held branches commit their changes and their reports while that segment waits.
        await worker.events.wait_until(lambda: worker.events.commits >= committed + 2)
        store.go.set()  # the claimed report's segment reads the two reports behind it
        info = await client.wait_for(iid)
        assert info.status == "COMPLETED", info.error
        joins = await _joins(rows, iid)
        assert len(joins) == 3 and len({c for _, _, c in joins}) == 1  # all three in the paused segment
        assert info.state["total"] == 1 + 4 + 9  # not 1: the state the claim read held the first branch only
    finally:
        RELEASE["branches"].set()
        store.go.set()
        await worker.stop()
        await client.detach()
        await store.close()
