"""The zombie checker's mutation really removes the fence, and says so loudly when it cannot.

`test_checker_catches_zombie_writes_when_the_fence_is_removed` is only meaningful if its mutation
changes what the database does; this checks that in a second, against the store's own API.
"""

from __future__ import annotations

import dataclasses
import uuid

import asyncpg
import pytest

from stepstone.core.effects import EndInstance, MovePosition, RecordHistory
from stepstone.core.model import Decision, Settle
from stepstone.store.port import CommitRequest
from stepstone.testing import open_engine
from tests.chaos.rig.mutation import FENCE, MutationAnchorGone, unfenced, unfenced_commit_segment
from tests.engine import workflows


async def _stale_commit_applies(database_url: str) -> bool:
    async with open_engine(database_url, workflows.registry) as engine:
        iid = await engine.client.start(workflows.three, {"order_id": "m-1"})
        [claim] = await engine.store.claim(1, 30, "w")
        assert claim.instance.id == iid
        finished = Decision(Settle("COMPLETE"), (
            MovePosition("COMPLETED", None, 2), RecordHistory("INSTANCE_COMPLETED", None, 2), EndInstance("COMPLETED"),
        ))
        stale = dataclasses.replace(claim, token=uuid.uuid4())
        request = CommitRequest(stale, claim.command.id, finished, 1)
        done = await engine.store.commit(request, lease_seconds=30, worker="z")
        return done is not None


async def test_the_mutation_lets_a_stale_token_commit(database_url: str) -> None:
    assert not await _stale_commit_applies(database_url)  # the fence as shipped
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(unfenced_commit_segment())
    finally:
        await conn.close()
    assert await _stale_commit_applies(database_url)  # the mutant: the zombie's write lands


def test_the_mutation_fails_loudly_when_its_anchor_is_gone() -> None:
    fenced = "CREATE FUNCTION s.f(d jsonb) AS $$ " + " ".join(old for old, _, n in FENCE for _ in range(n)) + "; $$"
    body = unfenced(fenced)
    assert "v_token" not in body and "CREATE OR REPLACE FUNCTION" in body
    with pytest.raises(MutationAnchorGone, match="fence moved"):
        unfenced("CREATE FUNCTION s.f(d jsonb) AS $$ UPDATE t SET x = 1 WHERE t.id = v_id; $$")
