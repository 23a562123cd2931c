"""Failure handling: retries and backoff, cancel, fencing, expired leases, poison commands, drain."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections import Counter

from stepstone.core.effects import EndInstance, MovePosition, RecordHistory, SetState
from stepstone.core.model import Decision, Settle
from stepstone.store.port import CommitRequest
from stepstone.testing import Engine
from tests.engine.conftest import Rows, kinds
from tests.engine.workflows import BACKOFF, FAILURES, HOLD, Hold, flaky, signals, three, timed


async def _hold_b(iid: str) -> Hold:
    hold = Hold()
    HOLD[iid] = hold
    return hold


# -- retries ------------------------------------------------------------------------------------------


async def test_failing_step_is_retried_after_its_backoff(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(flaky, {"order_id": "r-1"})
    FAILURES[iid] = 2
    events = engine.worker.events

    await engine.run_until_idle()
    assert events.claims == 1
    info = await engine.client.get(iid)
    assert info.status in ("PENDING", "RUNNING") and info.step == "work" and info.error is None
    [cmd] = await rows.open_commands(iid)
    assert cmd["state"] == "PENDING" and cmd["attempt"] == 2

    # Not claimable until the clock has moved by the backoff (10 s after attempt 1, then 20 s).
    await engine.move_clock(BACKOFF - 1)
    await engine.run_until_idle()
    assert events.claims == 1
    await engine.move_clock(1.5)
    await engine.run_until_idle()
    assert events.claims == 2
    await engine.move_clock(2 * BACKOFF - 1)
    await engine.run_until_idle()
    assert events.claims == 2
    await engine.move_clock(1.5)
    await engine.run_until_idle()

    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info
    assert info.state["log"] == ["work@3", "done"]
    history = await engine.client.history(iid)
    failed = [h["data"] for h in history if h["kind"] == "STEP_FAILED"]
    assert [(f["attempt"], f["type"], f["message"], f["retry_in"]) for f in failed] == [
        (1, "Flaky", "upstream busy (attempt 1)", BACKOFF),
        (2, "Flaky", "upstream busy (attempt 2)", 2 * BACKOFF),
    ]
    completed = [h for h in history if h["kind"] == "STEP_COMPLETED"]
    assert [(h["step"], h["data"]["attempt"]) for h in completed] == [("work", 3), ("done", 1)]


async def test_exhausted_retries_fail_the_instance_and_retry_redrives_it(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(flaky, {"order_id": "r-2"})
    FAILURES[iid] = 3
    await engine.run_until_idle()
    for delay in (BACKOFF, 2 * BACKOFF):
        await engine.move_clock(delay + 0.5)
        await engine.run_until_idle()

    info = await engine.client.get(iid)
    assert info.status == "FAILED" and info.step == "work"
    assert info.error == {"step": "work", "type": "Flaky", "message": "upstream busy (attempt 3)", "attempt": 3,
                          "frames": info.error["frames"]}  # where it raised: tests/engine/test_failure_frames.py
    assert kinds(await engine.client.history(iid))[-2:] == ["STEP_FAILED", "INSTANCE_FAILED"]
    assert await rows.open_commands(iid) == []
    assert [i["id"] for i in await engine.client.list(status="FAILED")] == [iid]

    await engine.client.retry(iid)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.error is None
    assert info.state["log"] == ["work@1", "done"]
    history = kinds(await engine.client.history(iid))
    assert history.count("INSTANCE_RETRIED") == 1 and history.count("STEP_FAILED") == 3


async def test_non_retryable_error_fails_at_once(engine: Engine) -> None:
    iid = await engine.client.start(flaky, {"order_id": "r-3"})
    FAILURES[iid] = -1
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED"
    assert info.error["type"] == "Fatal" and info.error["attempt"] == 1
    assert kinds(await engine.client.history(iid)).count("STEP_FAILED") == 1
    assert engine.worker.events.claims == 1


# -- cancel -------------------------------------------------------------------------------------------


async def test_cancel_settles_every_open_command_and_is_idempotent(engine: Engine, rows: Rows) -> None:
    timer = await engine.client.start(timed, {"order_id": "c-1"})
    parked = await engine.client.start(signals, {"order_id": "c-2"})
    await engine.run_until_idle()
    await engine.client.signal(parked, "later")
    await engine.run_until_idle()
    queued = await engine.client.start(three, {"order_id": "c-3"})  # START still PENDING
    claimed = await engine.client.start(three, {"order_id": "c-4"})
    [held] = await engine.store.claim(1, 30, "elsewhere")  # oldest available first: `queued`
    assert held.instance.id == queued
    queued, claimed = claimed, queued

    open_before = {iid: {(c["kind"], c["state"]) for c in await rows.open_commands(iid)}
                   for iid in (timer, parked, queued, claimed)}
    assert open_before == {
        timer: {("TIMER", "PENDING")},
        parked: {("TIMER", "PENDING"), ("SIGNAL", "PARKED")},
        queued: {("START", "PENDING")},
        claimed: {("START", "CLAIMED")},
    }
    for iid in (timer, parked, queued, claimed):
        assert await engine.client.cancel(iid, "customer asked") == "CANCELLED"
        assert await rows.open_commands(iid) == []
        cancelled = {(c["kind"], c["state"]) for c in await rows.commands(iid) if c["state"] == "CANCELLED"}
        assert cancelled == {(kind, "CANCELLED") for kind, _ in open_before[iid]}
        info = await engine.client.get(iid)
        assert info.status == "CANCELLED" and info.ended_at is not None
        assert info.next_timer_at is None and info.parked_signals == 0
        entry = (await engine.client.history(iid))[-1]
        assert entry["kind"] == "INSTANCE_CANCELLED" and entry["data"]["reason"] == "customer asked"

        before = await rows.dump()
        assert await engine.client.cancel(iid) == "CANCELLED"
        assert await rows.dump() == before
        assert kinds(await engine.client.history(iid)).count("INSTANCE_CANCELLED") == 1

    # Nothing wakes up later, and the zombie claim cannot commit.
    claims = engine.worker.events.claims
    await engine.move_clock(3600)
    await engine.run_until_idle()
    assert engine.worker.events.claims == claims
    for iid in (timer, parked, queued, claimed):
        assert (await engine.client.get(iid)).status == "CANCELLED"
    finished = Decision(Settle("COMPLETE"), (MovePosition("COMPLETED", None, 2), EndInstance("COMPLETED")))
    request = CommitRequest(held, held.command.id, finished, 1)
    assert await engine.store.commit(request, lease_seconds=30, worker="w") is None


async def test_cancel_during_a_running_handler_fences_its_commit(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(three, {"order_id": "c-6"})
    hold = await _hold_b(iid)
    running = asyncio.create_task(engine.run_until_idle())
    await asyncio.wait_for(hold.entered.wait(), 10)

    assert await engine.client.cancel(iid, "stop") == "CANCELLED"
    after_cancel = await rows.dump()
    hold.release.set()
    await asyncio.wait_for(running, 10)

    assert hold.finished
    assert engine.worker.events.fenced == 1
    assert await rows.dump() == after_cancel  # nothing the handler computed landed
    info = await engine.client.get(iid)
    assert info.status == "CANCELLED" and info.state["log"] == ["a"]
    assert await rows.count("SELECT count(*) FROM stepstone.outbox") == 0
    assert kinds(await engine.client.history(iid))[-1] == "INSTANCE_CANCELLED"


# -- leases and fencing --------------------------------------------------------------------------------


async def test_expired_lease_is_resumed_by_another_worker(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(three, {"order_id": "l-1"})
    hold = await _hold_b(iid)
    a = engine.worker
    running = asyncio.create_task(a.run_until_idle())
    await asyncio.wait_for(hold.entered.wait(), 10)

    b = engine.new_worker(concurrency=2, lease_seconds=30, worker_id="worker-b")
    await b.run_until_idle()
    assert b.events.claims == 0  # A's lease still holds

    await engine.move_clock(31)
    await b.run_until_idle()
    assert b.events.claims == 1 and b.events.commits == 2
    assert (await engine.client.get(iid)).status == "COMPLETED"

    hold.release.set()
    await asyncio.wait_for(running, 10)
    assert a.events.fenced == 1
    info = await engine.client.get(iid)
    assert info.state["log"] == ["a", "b", "c"]
    history = await engine.client.history(iid)
    assert Counter(h["step"] for h in history if h["kind"] == "STEP_COMPLETED") == {"a": 1, "b": 1, "c": 1}
    assert await rows.count("SELECT count(*) FROM stepstone.outbox") == 1
    # a, b and c ran in the START's row, going on in place (migration 0030); worker-b reclaimed it at b.
    [command] = await rows.commands(iid)
    assert (command["kind"], command["step"], command["state"]) == ("START", "c", "COMPLETE")
    assert command["claimed_by"] == "worker-b"
    b_done = await rows.conn.fetchval(
        "SELECT actor FROM stepstone.history WHERE instance_id = $1::uuid AND kind = 'STEP_COMPLETED' AND step = 'b'",
        iid)
    assert '"worker-b"' in b_done


async def test_commit_with_a_stale_token_changes_nothing(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(three, {"order_id": "f-1"})
    [claim] = await engine.store.claim(1, 30, "w")
    assert claim.instance.id == iid
    decision = Decision(
        Settle("COMPLETE"),
        (
            MovePosition("COMPLETED", None, 2),
            SetState({"order_id": "hijacked", "log": [], "data": {}}),
            RecordHistory("INSTANCE_COMPLETED", None, 2),
            EndInstance("COMPLETED"),
        ),
    )
    before = await rows.dump()
    stale = dataclasses.replace(claim, token=uuid.uuid4())
    stale_request = CommitRequest(stale, claim.command.id, decision, 1)
    assert await engine.store.commit(stale_request, lease_seconds=30, worker="w") is None
    assert await rows.dump() == before

    # The real token still works (the refusal above was the fence, not a broken decision).
    done = await engine.store.commit(CommitRequest(claim, claim.command.id, decision, 1), lease_seconds=30, worker="w")
    assert done is not None
    assert (await engine.client.get(iid)).status == "COMPLETED"


async def test_poison_command_is_dead_lettered_then_retryable(engine: Engine, rows: Rows) -> None:
    max_claims = engine.worker.config.max_claims
    iid = await engine.client.start(three, {"order_id": "p-1"})
    for n in range(1, max_claims + 2):
        [claim] = await engine.store.claim(1, 30, f"crashing-{n}")
        assert claim.command.claims == n
        if n > 1:  # claimed again: its worker runs it alone (runtime/alone.py) and marks the claim
            assert await engine.store.run_alone(iid, "", claim.token) == n - 2  # the earlier ones alone
        await engine.move_clock(31)  # the worker "dies": its lease runs out, nothing committed

    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED"
    assert info.error["type"] == "DeadLetter" and str(max_claims) in info.error["message"]
    history = kinds(await engine.client.history(iid))
    assert history[-2:] == ["COMMAND_DEAD_LETTERED", "INSTANCE_FAILED"]
    assert "STEP_COMPLETED" not in history
    [start] = await rows.commands(iid)
    assert start["state"] == "DEAD"

    await engine.client.retry(iid)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["log"] == ["a", "b", "c"]
    assert await rows.open_commands(iid) == []


async def test_a_claim_run_alone_is_marked_given_back_with_its_claim_and_not_counted_after_a_reset(
    engine: Engine, rows: Rows
) -> None:
    iid = await engine.client.start(three, {"order_id": "m-1"})
    [first] = await engine.store.claim(1, 30, "dies")
    await engine.move_clock(31)
    [second] = await engine.store.claim(1, 30, "alone")
    assert await engine.store.run_alone(iid, "", first.token) is None  # a stale token marks nothing
    assert await engine.store.run_alone(iid, "", second.token) == 0
    assert await engine.store.release(iid, "", second.token)  # given back (a drain): mark and claim both
    [third] = await engine.store.claim(1, 30, "alone")
    assert third.command.claims == 2
    assert await engine.store.run_alone(iid, "", third.token) == 0
    await engine.move_clock(31)
    [fourth] = await engine.store.claim(1, 30, "alone")
    assert await engine.store.run_alone(iid, "", fourth.token) == 1  # the third claim ran alone and died
    # Settled or rescheduled since (claims counted again from 0): the old marks count for nothing.
    await rows.conn.execute("UPDATE stepstone.commands SET claims = 0, state = 'PENDING', token = NULL, "
                            "available_at = stepstone.db_now() WHERE instance_id = $1", iid)
    await rows.conn.execute("UPDATE stepstone.positions SET lease_token = NULL, lease_until = NULL "
                            "WHERE instance_id = $1", iid)
    await engine.store.claim(1, 30, "dies")
    await engine.move_clock(31)
    [again] = await engine.store.claim(1, 30, "alone")
    assert again.command.claims == 2
    assert await engine.store.run_alone(iid, "", again.token) == 0
    [row] = await rows.commands(iid)
    assert row["alone_claims"] == 1
    await engine.move_clock(31)
    await engine.run_until_idle()  # run alone by the worker, it completes
    assert (await engine.client.get(iid)).status == "COMPLETED"


async def test_drain_releases_in_flight_claims(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(three, {"order_id": "d-1"})
    hold = await _hold_b(iid)
    worker = engine.new_worker(concurrency=2, lease_seconds=30, poll_interval=0.05, worker_id="draining")
    await worker.start()
    try:
        await asyncio.wait_for(hold.entered.wait(), 10)
    finally:
        await worker.stop(drain_timeout=0.2)

    assert worker.events.released == 1 and worker.events.fenced == 0
    assert not hold.finished  # the handler was cancelled, not completed
    [step_b] = [c for c in await rows.commands(iid) if c["step"] == "b"]
    assert step_b["state"] == "PENDING" and step_b["claims"] == 0 and step_b["token"] is None
    assert (await engine.client.get(iid)).state["log"] == ["a"]

    await engine.run_until_idle()  # no clock move: the released command is claimable at once
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["log"] == ["a", "b", "c"]
