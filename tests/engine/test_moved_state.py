"""A commit that writes no state, of a decision made on a state version another position has moved on
since, returns the current state, so the segment goes on from it (migration 0037). Without it, a join
that fired while a branch committed handed its next step the state from before that branch's change
under the new version, and the step's commit wrote over the change (a lost update)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from stepstone.core.effects import RecordHistory, SetState
from stepstone.core.model import Decision, Settle
from stepstone.store.port import Claim, CommitRequest, Committed
from stepstone.testing import Engine, open_engine
from tests.engine import branch_workflows as bw


async def _commit(engine: Engine, claim: Claim, decision: Decision) -> Committed | None:
    request = CommitRequest(claim, claim.command.id, decision, claim.instance.visit, claim.instance.state_version)
    return await engine.store.commit(request, lease_seconds=30, worker="test-worker")


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, bw.registry, concurrency=4, lease_seconds=30) as e:
        yield e


async def test_a_commit_without_state_on_a_moved_version_returns_the_current_state(engine: Engine) -> None:
    iid = await engine.client.start(bw.gated, {})
    await engine.run_until_idle()  # both gates wait for their signal
    for gate in ("g1", "g2"):
        await engine.client.signal(iid, "open", gate, position=f"gates/{gate}")
    claims = {c.instance.position: c for c in await engine.store.claim(2, 30, "test-worker")}
    first, second = claims["gates/g1"], claims["gates/g2"]
    assert first.instance.state_version == second.instance.state_version
    moved = {**first.instance.state, "log": ["g1"]}
    changed = Decision(Settle("COMPLETE"), (SetState(moved, ({"path": ["log"], "old": [], "value": ["g1"]},)),))
    one = await _commit(engine, first, changed)
    assert one is not None and not one.conflict and one.state is None  # made on the current version

    plain = Decision(Settle("COMPLETE"), (RecordHistory("NOTED", "gate", second.instance.visit),))
    two = await _commit(engine, second, plain)
    assert two is not None and not two.conflict
    assert two.state_version == one.state_version
    assert two.state == moved  # not None: the segment must not go on from the state it claimed


async def test_a_commit_without_state_on_the_current_version_returns_none(engine: Engine) -> None:
    iid = await engine.client.start(bw.gated, {})
    await engine.run_until_idle()
    await engine.client.signal(iid, "open", "g1", position="gates/g1")
    (claim,) = await engine.store.claim(1, 30, "test-worker")
    plain = Decision(Settle("COMPLETE"), (RecordHistory("NOTED", "gate", claim.instance.visit),))
    done = await _commit(engine, claim, plain)
    assert done is not None and done.state is None and done.state_version == claim.instance.state_version
