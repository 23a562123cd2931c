"""Tests that catch bugs planted by hand that the suite let through (issue 9, item 20).

Each is written against behaviour (outcomes through the store, client and worker), not SQL
text, and was seen to fail with its bug planted: a lease loop that never renews, a claim
without its re-check under the row lock, a group commit in descending instance order, a claim
without the queue-head rule, a cancel that leaves timers or parked signals open.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest

from stepstone.core.effects import EmitEvent, EndInstance, MovePosition, RecordHistory
from stepstone.core.model import Decision, Settle
from stepstone.runtime.counters import Counters
from stepstone.store.port import CommitRequest
from stepstone.testing import Engine
from tests._pg import until_blocked
from tests.engine.conftest import Rows
from tests.engine.hardening import workflows as hw

DEADLINE = 30.0


@dataclass
class Renewals(Counters):
    """Lease renewals that kept a lease, counted as the store answers them."""

    kept: int = 0


# -- the worker renews its leases -----------------------------------------------------------------------------


async def test_a_step_held_past_two_renewal_periods_is_claimed_once_and_never_fenced(
    engine: Engine, rows: Rows, monkeypatch: pytest.MonkeyPatch
) -> None:
    iid = await engine.client.start(hw.held_async, {})
    renewals, renew = Renewals(), engine.store.renew

    async def counted(held: dict[tuple[str, str], Any], lease_seconds: float) -> set[tuple[str, str]]:
        kept = await renew(held, lease_seconds)
        if any(key[0] == iid for key in kept):
            renewals.count("kept")
        return kept

    monkeypatch.setattr(engine.store, "renew", counted)
    gate = hw.GATE[iid] = hw.Gate()
    holder = engine.new_worker(concurrency=2, lease_seconds=1.0, poll_interval=0.05, worker_id="holder")
    rival = engine.new_worker(concurrency=2, lease_seconds=1.0, poll_interval=0.05, worker_id="rival")
    await holder.start()
    try:
        await asyncio.wait_for(gate.async_entered.wait(), DEADLINE)
        await rival.start()  # claims whatever the holder stops renewing
        # 8 renewal periods (2.7 leases): a lease the holder did not renew would have expired long
        # before, and the rival, polling every 0.05 s, taken the step over.
        await renewals.wait_until(lambda: renewals.kept >= 8, timeout=DEADLINE)
        gate.async_opened.set()
        await holder.events.wait_until(lambda: holder.events.commits >= 1, timeout=DEADLINE)
    finally:
        await rival.stop(drain_timeout=5)
        await holder.stop(drain_timeout=5)

    assert holder.events.claims == 1 and holder.events.fenced == 0
    assert rival.events.claims == 0
    assert hw.RUNS[iid, "held_async_step"] == 1
    [cmd] = await rows.commands(iid)
    assert cmd["claims"] == 1 and cmd["claimed_by"] == "holder" and cmd["state"] == "COMPLETE"
    assert (await engine.client.get(iid)).status == "COMPLETED"


# -- the claim re-checks the command under the lock -----------------------------------------------------------


async def test_a_command_settled_while_the_claim_waits_for_its_lock_is_not_claimed(
    engine: Engine, rows: Rows, database_url: str
) -> None:
    iid = await engine.client.start(hw.held_sync, {})
    [cmd] = await rows.commands(iid)
    other = await asyncpg.connect(database_url)
    try:
        settling = other.transaction()
        await settling.start()
        # A second connection settles the command and holds its row lock, uncommitted.
        await other.execute(
            "UPDATE stepstone.commands SET state = 'CANCELLED', settled_at = now() WHERE id = $1", cmd["id"]
        )
        claiming = asyncio.create_task(engine.store.claim(5, 30, "claimer"))
        await until_blocked(rows.conn, other, timeout=DEADLINE, failure="the claim never waited for the lock")
        await settling.commit()
        claims = await asyncio.wait_for(claiming, DEADLINE)
    finally:
        await other.close()
    assert claims == []
    [after] = await rows.commands(iid)
    assert after["state"] == "CANCELLED" and after["token"] is None and after["claims"] == 0


# -- the group commit takes instances in ascending id order ---------------------------------------------------


async def test_group_commit_writes_instances_in_ascending_id_order(engine: Engine, rows: Rows) -> None:
    ids = [await engine.client.start(hw.held_sync, {}) for _ in range(6)]
    claims = {c.instance.id: c for c in await engine.store.claim(6, 30, "grouped")}
    assert sorted(claims) == sorted(ids)

    def finish(iid: str) -> Decision:
        return Decision(Settle("COMPLETE"), (
            MovePosition("COMPLETED", None, 2), RecordHistory("INSTANCE_COMPLETED", None, 2),
            EmitEvent("done", {"instance": iid}), EndInstance("COMPLETED"),
        ))

    newest_first = sorted(ids, key=uuid.UUID, reverse=True)
    requests = [CommitRequest(claims[i], claims[i].command.id, finish(i), 1) for i in newest_first]
    results = await engine.store.commit_many(requests, lease_seconds=30, worker="grouped")
    assert all(r is not None for r in results)

    # The outbox's identity is taken as each item is written: it shows the order instances were locked.
    written = [str(r["instance_id"]) for r in
               await rows.conn.fetch("SELECT instance_id FROM stepstone.outbox ORDER BY id")]
    assert written == sorted(ids, key=uuid.UUID)


# -- the queue-head rule ----------------------------------------------------------------------------------------


async def test_a_head_waiting_out_its_retry_backoff_blocks_a_ready_signal(engine: Engine) -> None:
    iid = await engine.client.start(hw.backoff_wf, {})
    hw.RAISE[iid] = RuntimeError("not yet")
    await engine.run_until_idle()  # the first step failed; its retry is due in 10 s
    await engine.client.signal(iid, "go")  # ready now, but behind the retry
    assert await engine.store.claim(10, 30, "w") == []
    await engine.move_clock(10.5)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["log"] == ["through:go"]
    assert hw.RUNS[iid, "first_try"] == 2


async def test_a_released_head_still_blocks_what_is_behind_it(engine: Engine) -> None:
    iid = await engine.client.start(hw.gated, {})
    await engine.client.signal(iid, "go")
    [claim] = await engine.store.claim(10, 30, "w")
    assert await engine.store.release(iid, "", claim.token)
    again = await engine.store.claim(10, 30, "w")
    assert [c.command.kind for c in again] == ["START"]


async def test_a_future_timer_blocks_nothing_but_a_due_one_is_the_head(engine: Engine, rows: Rows) -> None:
    early = await engine.client.start(hw.gated, {})
    late = await engine.client.start(hw.gated, {})
    await engine.run_until_idle()  # both wait at the gate, with a timeout timer in an hour
    await engine.client.signal(early, "go")  # behind a timer that is not due: runs now
    claims = await engine.store.claim(10, 30, "w")
    assert [(c.instance.id, c.command.kind) for c in claims] == [(early, "SIGNAL")]

    await engine.move_clock(3601)  # both timeouts are due; `early`'s claim of its signal has expired
    await engine.client.signal(late, "go")  # behind a timer that is due: the timer goes first
    claims = await engine.store.claim(10, 30, "w")
    # `early`'s signal was recorded before its timeout's fire time, so it holds the timeout back (issue 11).
    assert {(c.instance.id, c.command.kind) for c in claims} == {(early, "SIGNAL"), (late, "TIMER")}


async def test_signals_sent_to_a_running_step_wait_for_it(engine: Engine) -> None:
    iid = await engine.client.start(hw.gated, {})
    worker = engine.worker
    await worker.run_until_idle()
    await engine.client.signal(iid, "go")
    await engine.client.signal(iid, "go")  # a second one: parked after the first moved the instance on
    await worker.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["log"] == ["through:go"]


# -- cancel settles timers and parked signals -------------------------------------------------------------------


async def test_cancel_settles_timers_and_parked_signals_and_nothing_runs_after(engine: Engine, rows: Rows) -> None:
    napping = await engine.client.start(hw.parker, {})  # its timer is not due
    due = await engine.client.start(hw.parker, {})  # its timer will be due, never claimed
    gate = await engine.client.start(hw.gated, {})  # a timeout timer and a signal it accepts, queued
    await engine.run_until_idle()
    for iid in (napping, due):
        await engine.client.signal(iid, "go")
    await engine.run_until_idle()  # the signals are parked: nobody waits for them yet
    await engine.move_clock(61)  # `due`'s timer is due; the gate's timeout is not
    await engine.client.signal(gate, "go")

    expected = {
        napping: {("TIMER", "PENDING"), ("SIGNAL", "PARKED")},
        due: {("TIMER", "PENDING"), ("SIGNAL", "PARKED")},
        gate: {("TIMER", "PENDING"), ("SIGNAL", "PENDING")},
    }
    assert {iid: {(c["kind"], c["state"]) for c in await rows.open_commands(iid)} for iid in expected} == expected
    for iid, open_before in expected.items():
        assert await engine.client.cancel(iid, "stop") == "CANCELLED"
        assert await rows.open_commands(iid) == []
        settled = {(c["kind"], c["state"], c["last_error"]) for c in await rows.commands(iid)
                   if c["kind"] in ("TIMER", "SIGNAL")}
        assert settled == {(kind, "CANCELLED", f"INSTANCE_CANCELLED: {kind}") for kind, _ in open_before}
        info = await engine.client.get(iid)
        assert info.next_timer_at is None and info.parked_signals == 0

    claims = engine.worker.events.claims
    await engine.move_clock(10 ** 6)
    await engine.run_until_idle()
    assert engine.worker.events.claims == claims
    assert [(await engine.client.get(i)).status for i in expected] == ["CANCELLED"] * 3
