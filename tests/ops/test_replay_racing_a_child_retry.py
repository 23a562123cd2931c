"""An operator replays a parent from its child step while the parent's failed child is being retried.

The parent (ops_caller) failed because its child (ops_fragile) failed for good. Once the upstream is back
the operator both retries the child and replays the parent from its child step: in either order before
a worker runs, with the retried child already ended, and with the replay committed while the child's
retried step is under way. Each time the parent completes once, on the new child the replay started;
the old child ends on its own and its report is settled REJECTED and recorded as CALLBACK_IGNORED, never
applied; nothing of the parent is left open. The child's step ran in both children: the operator asked
for it twice (docs/operations.md, "Children and replay").
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import asyncpg
import pytest

from stepstone.ops import Operations
from stepstone.testing import Engine
from tests.ops import workflows

ORDERS = ("retry, replay", "replay, retry", "retry ran, replay", "replay during the retried step")


@pytest.fixture(autouse=True)
def _calls() -> Iterator[None]:
    workflows.CALLS.clear()
    workflows.HOLD.clear()
    yield
    workflows.HOLD.clear()


async def _failed_tree(engine: Engine) -> tuple[str, str]:
    """A parent FAILED (ChildFailed) on its FAILED child; the upstream is back afterwards."""
    workflows.FAILURES[workflows.fragile.id] = -1
    parent = await engine.client.start(workflows.caller, {})
    await engine.run_until_idle()
    workflows.FAILURES.pop(workflows.fragile.id)
    [child] = [str(c["id"]) for c in (await engine.client.get(parent)).children]
    assert ((await engine.client.get(parent)).status, (await engine.client.get(child)).status) == ("FAILED", "FAILED")
    return parent, child


async def _replay_during_the_retried_step(engine: Engine, ops: Operations, parent: str, child: str) -> None:
    workflows.HOLD.update(entered=asyncio.Event(), release=asyncio.Event())
    await ops.retry([child])
    running = asyncio.create_task(engine.run_until_idle())
    await asyncio.wait_for(workflows.HOLD["entered"].wait(), 30)
    release = workflows.HOLD["release"]
    workflows.HOLD.clear()  # the new child's step goes straight through
    assert (await engine.client.get(child)).status == "RUNNING"
    await ops.replay(parent, "call_fragile")
    release.set()
    await running


@pytest.mark.parametrize("order", ORDERS)
async def test_a_parent_replayed_while_its_child_is_retried_completes_once_on_its_new_child(
    engine: Engine, ops: Operations, conn: asyncpg.Connection, order: str
) -> None:
    parent, old = await _failed_tree(engine)
    if order == "replay during the retried step":
        await _replay_during_the_retried_step(engine, ops, parent, old)
    else:
        for action in order.split(", "):
            if action == "retry ran":
                await ops.retry([old])
                await engine.run_until_idle()
            elif action == "retry":
                assert (await ops.retry([old])).succeeded == 1
            else:
                assert (await ops.replay(parent, "call_fragile")).visit == 2
    await engine.run_until_idle()
    info = await engine.client.get(parent)
    [new] = [str(c["id"]) for c in info.children if str(c["id"]) != old]
    assert {str(c["id"]): c["status"] for c in info.children} == {old: "COMPLETED", new: "COMPLETED"}
    assert (info.status, info.state) == ("COMPLETED", {"result": f"paid by {new}", "child_id": new})
    assert sorted(workflows.CALLS) == sorted([old, new])  # each child's step once, the old one's on its retry
    history = await engine.client.history(parent)
    kinds = [e["kind"] for e in history]
    assert (kinds.count("CHILD_COMPLETED"), kinds.count("INSTANCE_COMPLETED")) == (1, 1)
    [done] = [e["data"] for e in history if e["kind"] == "CHILD_COMPLETED"]
    [ignored] = [e["data"] for e in history if e["kind"] == "CALLBACK_IGNORED"]
    assert (done["child_id"], ignored["kind"], ignored["reason"]) == (new, "CHILD_COMPLETION", "CHILD_NOT_AWAITED")
    reports = await conn.fetch("SELECT state, last_error, payload->>'child_id' AS child FROM stepstone.commands "
                               "WHERE instance_id = $1 AND kind = 'CHILD_COMPLETION' ORDER BY seq, id",
                               uuid.UUID(parent))
    assert sorted((r["child"], r["state"], r["last_error"] or "") for r in reports) == sorted([
        (old, "FAILED", f"ChildFailed: child {old} ended FAILED: upstream down"),  # what failed the parent
        (old, "REJECTED", "CHILD_NOT_AWAITED"),  # the retried child's report: settled, never applied
        (new, "COMPLETE", ""),
    ])
    assert await conn.fetchval("SELECT count(*) FROM stepstone.commands WHERE instance_id = ANY($1::uuid[]) "
                               "AND state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED')", [parent, old, new]) == 0
