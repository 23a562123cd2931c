"""Dead-lettered commands that carry a result found nowhere else, and the retry of their instance, against
real PostgreSQL.

A command that crashes its workers until its attempts run out is dead-lettered (DEAD) and fails its position
and the instance; the position keeps its wait. A branch's report to its join, an external task's completion,
a child's report and a human task's completion each carry what the instance would go on with: the retry must
neither lose it (the instance waiting for ever) nor have its work done again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.core.model import Decision
from stepstone.core.transitions import apply
from stepstone.store.port import CommitRequest
from stepstone.testing import Engine, open_engine
from tests.crashes import die_alone
from tests.engine.conftest import kinds

RUNS: dict[str, int] = {}
"""How many times each branch step's handler ran."""

# Three branches: `a` runs a step, `b` and `c` wait for the signal `go`, which takes them to the join.
forked = Workflow("dead_fork", version=1)
forked.fork("split", branches={"a": "quick", "b": "hold", "c": "hold"}, start=True)


@forked.step(next="met")
async def quick(ctx: StepContext, state: dict[str, Any]) -> None:
    RUNS["quick"] = RUNS.get("quick", 0) + 1


forked.wait("hold", signals={"go": "met"})
forked.join("met", fork="split", next="after")


@forked.step(next=None)
async def after(ctx: StepContext, state: dict[str, Any]) -> None:
    state["after"] = True


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    RUNS.clear()
    async with open_engine(database_url, Registry(forked), concurrency=2, max_claims=3) as e:
        yield e


async def _commit_one(engine: Engine, workflow: Workflow[Any]) -> None:
    """Claim the one claimable command and commit it as a worker would (it runs no handler)."""
    [claim] = await engine.store.claim(1, 30, "w")
    decision = apply(claim.instance, claim.command, workflow.plan, claim.now)
    assert isinstance(decision, Decision), decision
    assert await engine.store.commit(CommitRequest(claim, claim.command.id, decision, claim.instance.visit,
                                                   claim.instance.state_version), lease_seconds=30, worker="w")


async def _reports(conn: asyncpg.Connection, iid: str) -> list[tuple[str, str]]:
    rows = await conn.fetch("SELECT payload->>'branch' AS branch, state FROM stepstone.commands "
                            "WHERE instance_id = $1::uuid AND kind = 'BRANCH_DONE' ORDER BY id", iid)
    return [(r["branch"], r["state"]) for r in rows]


async def _join_failed_at_bs_report(engine: Engine) -> str:
    """`a` joined; `b`'s report dead-lettered at the join: the fork's position (the root) FAILED with its
    join's count kept, the instance FAILED; `c` still waits."""
    c = engine.client
    iid = await c.start(forked, {})
    await engine.run_until_idle()
    await c.signal(iid, "go", position="split/b")
    await _commit_one(engine, forked)  # b reaches the join: its report is queued on the root
    assert {claim.command.kind for claim in await die_alone(engine)} == {"BRANCH_DONE"}
    await engine.run_until_idle()
    info = await c.get(iid)
    assert info.status == "FAILED" and info.error is not None and info.error["type"] == "DeadLetter"
    [root] = [p for p in info.positions if p["path"] == ""]
    assert (root["status"], root["wait"]["done"]) == ("FAILED", 1)
    return iid


async def test_a_report_reaching_a_failed_join_waits_for_the_retry(engine: Engine, conn: asyncpg.Connection) -> None:
    """Another branch's report reaching the join after it failed at a dead report was counted there: the
    failed position was set WAITING again, and the instance with it (its error kept), with the dead report
    never counted, so the join waited for ever and the retry was refused (not FAILED). It is parked."""
    c = engine.client
    iid = await _join_failed_at_bs_report(engine)
    await c.signal(iid, "go", position="split/c")
    await engine.run_until_idle()
    info = await c.get(iid)
    [root] = [p for p in info.positions if p["path"] == ""]
    assert (info.status, root["status"], root["wait"]["done"]) == ("FAILED", "FAILED", 1)
    assert await _reports(conn, iid) == [("split/a", "COMPLETE"), ("split/b", "DEAD"), ("split/c", "PARKED")]
    assert kinds(await c.history(iid))[-1] == "BRANCH_PARKED"
