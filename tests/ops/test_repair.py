"""Repair: bulk retry and cancel with a dry run and a result per instance; replay from a step."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from stepstone.errors import InvalidInput, InvalidState
from stepstone.ops import InstanceFilter, Operations
from stepstone.testing import Engine
from tests.ops import workflows


async def test_bulk_retry_of_ten_thousand_failed_instances(
    engine: Engine, ops: Operations, conn: asyncpg.Connection
) -> None:
    await workflows.failed_rows(conn, workflows.flaky.plan, "work", 10_000)
    done = await _completed_ids(engine, 3)
    where = InstanceFilter(status=("FAILED",), workflow="ops_flaky")
    dry = await ops.retry(where=where, dry_run=True)
    assert (dry.matched, dry.succeeded, dry.items) == (10_000, 0, [])
    assert await conn.fetchval("SELECT count(*) FROM stepstone.commands WHERE kind = 'RETRY'") == 0
    seen: list[tuple[int, int]] = []
    report = await ops.retry(where=where, progress=lambda n, total: seen.append((n, total)))
    assert (report.matched, report.succeeded, report.failed) == (10_000, 10_000, 0)
    assert len(seen) == 20 and seen[-1] == (10_000, 10_000)  # 500 a batch
    assert await conn.fetchval("SELECT count(*) FROM stepstone.commands WHERE kind = 'RETRY' AND state = 'PENDING' "
                               "AND actor = 'oncall'") == 10_000
    # A selection with instances that cannot be retried says which and why.
    mixed = await ops.retry([*done, "00000000-0000-0000-0000-000000000000"])
    assert (mixed.matched, mixed.succeeded, mixed.failed) == (4, 0, 4)
    reasons = {i.id: i.reason for i in mixed.items}
    assert reasons["00000000-0000-0000-0000-000000000000"] == "no such instance"
    refused = "it is COMPLETED; only a FAILED or COMPENSATION_FAILED instance can be retried"
    assert all(reasons[i] == refused for i in done)


async def _completed_ids(engine: Engine, n: int) -> list[str]:
    ids = [await engine.client.start(workflows.flaky, {}) for _ in range(n)]
    await engine.run_until_idle()
    return ids


async def test_cancel_by_filter(engine: Engine, ops: Operations) -> None:
    waiting = [await engine.client.start(workflows.flaky, {"name": f"w{n}"}) for n in range(3)]
    for iid in waiting:
        workflows.FAILURES[iid] = 1  # waiting out a retry backoff when the cancel comes
    done = await _completed_ids(engine, 2)
    report = await ops.cancel(where=InstanceFilter(workflow="ops_flaky"), reason="cleanup")
    assert report.matched == 5
    outcome = {i.id: (i.ok, i.outcome) for i in report.items}
    assert all(outcome[i] == (False, "unchanged") for i in done)
    assert all(outcome[i] == (True, "cancelled") for i in waiting)


async def test_replay_from_a_step_before_a_fork(engine: Engine, ops: Operations) -> None:
    iid = await engine.client.start(workflows.forky, {})
    workflows.FAILURES[iid] = 1
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED" and info.state["results"] == {"left": 1, "right": 1}
    with pytest.raises(InvalidInput, match="step 'nope' never ran in this instance; it ran: finish, prepare"):
        await ops.replay(iid, "nope")
    result = await ops.replay(iid, "prepare")
    # The state it had when it reached `prepare`: before prepare and both branches ran.
    assert result.state == {"name": "job", "log": [], "results": {}, "counter": 0}
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED"
    assert info.state["log"] == ["prepare:1", "finish"] and info.state["results"] == {"left": 1, "right": 1}
    history = (await ops.history(iid, limit=1000)).entries
    kinds = [e.kind for e in history]
    replayed = kinds.index("INSTANCE_REPLAYED")
    # The old path stays: the failure before the replay, the fresh branches after it.
    assert "INSTANCE_FAILED" in kinds[:replayed]
    assert kinds[replayed:].count("BRANCH_COMPLETED") == 2
    entry = history[replayed]
    assert entry.actor is not None and entry.actor.id == "oncall" and entry.data["from_step"] == "prepare"
    positions = {p["path"]: p["status"] for p in info.positions}
    assert positions == {"": "COMPLETED", "split/left": "COMPLETED", "split/right": "COMPLETED"}


async def test_replay_from_the_fork_step_and_after_the_join(engine: Engine, ops: Operations) -> None:
    iid = await engine.client.start(workflows.forky, {})
    workflows.FAILURES[iid] = 2
    await engine.run_until_idle()
    # From the join's next step: the branches' results are part of the state it had there.
    result = await ops.replay(iid, "finish")
    assert result.state["results"] == {"left": 1, "right": 1} and result.state["counter"] == 1
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "FAILED"  # finish failed once more
    result = await ops.replay(iid, "split")
    assert result.state["results"] == {} and result.state["counter"] == 1
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["results"] == {"left": 1, "right": 1}


async def test_replay_refuses_an_active_instance(engine: Engine, ops: Operations) -> None:
    iid = await engine.client.start(workflows.flaky, {})
    workflows.FAILURES[iid] = 1
    await engine.run_until_idle()  # waiting out a retry backoff: RUNNING
    with pytest.raises(InvalidState, match="cancel it"):
        await ops.replay(iid, "work")


async def test_replay_from_a_step_inside_a_branch_runs_its_fork_again(engine: Engine, ops: Operations) -> None:
    iid = await engine.client.start(workflows.forky, {})
    workflows.FAILURES[iid] = 1
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "FAILED"
    result = await ops.replay(iid, "left")
    # Branches share the state and the join waits for all: the fork that opened `left` runs again.
    assert (result.requested_step, result.from_step) == ("left", "split")
    assert result.state["results"] == {} and result.state["counter"] == 1
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["results"] == {"left": 1, "right": 1}
    assert info.state["log"] == ["prepare:1", "finish"]  # prepare, before the fork, did not run again
    kinds = [e.kind for e in (await ops.history(iid, limit=1000)).entries]
    replayed = kinds.index("INSTANCE_REPLAYED")
    assert kinds[:replayed].count("FORK_STARTED") == 1 and kinds[replayed:].count("FORK_STARTED") == 1
    assert kinds[replayed:].count("BRANCH_COMPLETED") == 2


async def _confirmed(engine: Engine) -> tuple[str, str]:
    """A completed ops_confirmed instance and its completed child."""
    iid = await engine.client.start(workflows.confirmed, {"order": "o-9", "card": "4000-0000"})
    await engine.run_until_idle()
    await engine.client.signal(iid, "otp", {"otp": "123456"})
    await workflows.run_out_backoffs(engine, rounds=2)
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info
    (child,) = [c["id"] for c in (await Operations.on(engine.store).detail(iid)).children]
    return iid, str(child)


async def test_replaying_a_parent_from_its_child_step_starts_a_new_child(engine: Engine, ops: Operations) -> None:
    iid, old_child = await _confirmed(engine)
    result = await ops.replay(iid, "keep_card")
    assert result.from_step == "keep_card"
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"
    children = {str(c["id"]): c["status"] for c in (await ops.detail(iid)).children}
    # The new visit of the child step derives a new child id; the old child stays as it ended.
    assert len(children) == 2 and children[old_child] == "COMPLETED"
    assert all(status == "COMPLETED" for status in children.values())
    kinds = [e.kind for e in (await ops.history(iid, limit=1000)).entries]
    assert kinds.count("CHILD_STARTED") == 2 and kinds.count("CHILD_COMPLETED") == 2


async def test_a_replayed_child_does_not_move_a_parent_that_no_longer_waits(
    engine: Engine, ops: Operations, conn: asyncpg.Connection
) -> None:
    iid, child = await _confirmed(engine)
    before = [e.kind for e in (await ops.history(iid, limit=1000)).entries]
    state = (await engine.client.get(iid)).state
    await ops.replay(child, "store_card")
    await engine.run_until_idle()
    assert (await engine.client.get(child)).status == "COMPLETED"
    parent = await engine.client.get(iid)
    assert parent.status == "COMPLETED" and parent.state == state
    reports = await conn.fetch("SELECT state, last_error FROM stepstone.commands WHERE instance_id = $1 "
                               "AND kind = 'CHILD_COMPLETION' ORDER BY id", uuid.UUID(iid))
    # The late report is settled (nothing left open to hold retention back) and never applied.
    assert [(r["state"], r["last_error"]) for r in reports] == [("COMPLETE", None), ("REJECTED", "INSTANCE_ENDED")]
    after = [e.kind for e in (await ops.history(iid, limit=1000)).entries]
    assert after == before


async def test_a_replayed_step_gets_the_signal_or_message_that_led_to_it(engine: Engine, ops: Operations) -> None:
    """A new attempt of the step, as a retry is: its handler read ctx.signal as None and overwrote what the
    signal had given (the order example's ship step set payment_id to None)."""
    iid = await engine.client.start(workflows.relayed, {"key": "r-1"})
    await engine.run_until_idle()
    await engine.client.signal(iid, "go", {"n": 7})
    await engine.run_until_idle()
    await engine.client.publish_message("paid", "r-1", {"ref": "pay-1"})
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).state == {"key": "r-1", "n": 7, "ref": "pay-1", "runs": 2}
    await ops.replay(iid, "took_message")
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).state == {"key": "r-1", "n": 7, "ref": "pay-1", "runs": 2}
    await ops.replay(iid, "took_signal")
    await engine.run_until_idle()
    info = await engine.client.get(iid)  # the replay goes on from the step: the message wait is open again
    assert (info.status, info.state) == ("WAITING", {"key": "r-1", "n": 7, "ref": "", "runs": 1})
