"""Signals queued behind another on their position wait off the claims' walk (migration 0072).

A position runs its commands one at a time; the claim walks the ready ones in time order and skips each
that queues behind an open one. Every signal of a burst sent to one instance was walked, and looked up,
by every claim until its turn: 1,000 of them made each claim read 1,000 rows. Now a signal recorded behind
another still open is available only a minute on, and the one ahead leaving the queue makes it available
at once: the walk never reaches the rest of a burst, and each still runs in its turn, in order.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import timedelta

import asyncpg
import pytest
from pydantic import BaseModel, Field

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.bench.common import bench_queries
from stepstone.testing import Engine, open_engine
from tests.perf.generic_plans import function_statement, scans_over


class Tally(BaseModel):
    seen: list[int] = Field(default_factory=list)
    goal: int = 0


tally: Workflow[Tally] = Workflow("queued_tally", version=1, state=Tally)


@tally.step(start=True, next="w")
async def begin(_ctx: StepContext, _state: Tally) -> None:
    return None


tally.wait("w", signals={"tick": "count"}, timeout=timedelta(hours=1), on_timeout="done")


@tally.step(next=["w", "later", "done"])
async def count(ctx: StepContext, state: Tally) -> str:
    payload = ctx.signal.payload if ctx.signal else {"k": -1}
    state.seen.append(int(payload["k"]))
    if payload.get("later"):
        return "later"
    return "done" if len(state.seen) >= state.goal else "w"


tally.wait("later", signals={"other": "done"}, timeout=timedelta(hours=1), on_timeout="done")


@tally.step(next=None)
async def done(_ctx: StepContext, _state: Tally) -> None:
    return None


registry = Registry(tally)


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, registry, concurrency=4, lease_seconds=30, max_claims=3) as e:
        yield e


async def _signals(conn: asyncpg.Connection, iid: str) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT id, name, state, created_at, available_at, settled_at, stepstone.db_now() AS now"
        " FROM stepstone.commands WHERE instance_id = $1::uuid AND kind = 'SIGNAL' ORDER BY seq, id", iid)


async def test_a_burst_waits_off_the_walk_and_runs_in_order(engine: Engine, conn: asyncpg.Connection) -> None:
    iid = await engine.client.start(tally, Tally(goal=30))
    await engine.run_until_idle()
    for k in range(30):
        await engine.client.signal(iid, "tick", {"k": k})
    queued = await _signals(conn, iid)
    # The first is available as it was recorded; the 29 behind it are not, so the claims' walk (available
    # ones, in time order) ends before them.
    assert queued[0]["available_at"] <= queued[0]["now"]
    assert [s["available_at"] > s["now"] for s in queued[1:]] == [True] * 29
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.state["seen"]) == ("COMPLETED", list(range(30)))
    ran = await _signals(conn, iid)
    # Each became claimable when the one ahead of it left the queue: a minute on, the run would have
    # gone idle with 29 signals still waiting.
    assert [s["state"] for s in ran] == ["COMPLETE"] * 30


async def test_a_parked_head_lets_the_next_one_run(engine: Engine, conn: asyncpg.Connection) -> None:
    iid = await engine.client.start(tally, Tally(goal=2))
    await engine.run_until_idle()
    await engine.client.signal(iid, "other", {})  # the wait `w` does not take it: parked when applied
    await engine.client.signal(iid, "tick", {"k": 7})
    other, tick = await _signals(conn, iid)
    assert other["available_at"] <= other["now"] < tick["available_at"]
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.step, info.state["seen"]) == ("w", [7])
    other, tick = await _signals(conn, iid)
    assert (other["state"], tick["state"]) == ("PARKED", "COMPLETE")


async def test_a_claim_reads_none_of_a_burst_queued_behind_its_head(
    engine: Engine, conn: asyncpg.Connection,
) -> None:
    """1,000 signals queued on one instance, 20 other instances ready: the claim takes the burst's head and
    the others, and no scan of `commands` in its plan touches more than 100 rows (before: the whole burst,
    each row looked up for an open one ahead of it)."""
    hot = await engine.client.start(tally, Tally(goal=2_000))
    await engine.run_until_idle()
    await conn.executemany(
        "SELECT stepstone.send_signal($1::uuid, 'tick', $2::jsonb, NULL, '', NULL)",
        [(hot, json.dumps({"k": k})) for k in range(1_000)])
    await engine.client.start_many(tally, [Tally(goal=1) for _ in range(20)])
    await conn.execute(bench_queries("stepstone")["analyze"])
    await conn.execute(f"PREPARE claim AS {await function_statement(conn, 'claim_heads')}")
    async with conn.transaction():
        plan = json.loads(await conn.fetchval(
            "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE claim(8, 30.0, 'plans', NULL)"))[0]["Plan"]
        claimed = await conn.fetch("SELECT instance_id::text, kind FROM stepstone.commands WHERE state = 'CLAIMED'")
    assert len(claimed) == 8 and (hot, "SIGNAL") in {(r["instance_id"], r["kind"]) for r in claimed}
    assert scans_over(plan, "commands", 100) == set()
