"""A deadline's timer held by a worker that died: its lease has expired and no worker has claimed it again.
A late commit the deadline holds (the one that would end the instance, or a step's past its step deadline)
takes the timer over and fires the deadline there, as it does a due timer no worker holds; the dead
worker's own commit of the timer, if it ever comes, is fenced (migration 0065)."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from stepstone.core.saga import SAGA
from stepstone.testing import Engine
from tests.sagas import workflows as w
from tests.sagas.conftest import assert_ended, kinds

CASES = {
    # workflow, its deadline's timer, the entry the deadline writes
    "instance": (w.tardy, "deadline", "DEADLINE_PASSED"),
    "step": (w.timely, "step_deadline", "STEP_DEADLINE_PASSED"),
}


@pytest.mark.parametrize("deadline", sorted(CASES))
async def test_a_late_commit_takes_over_a_deadline_timer_a_dead_worker_holds(
    engine: Engine, conn: asyncpg.Connection, deadline: str
) -> None:
    """The held handler (tardy's last step, timely's `slow` with its 5 s step deadline) returns after its
    deadline, while a worker that claimed the deadline's timer died with it (its lease expired, nobody took it
    over yet). The commit was refused and waited for that lease: the step's command stayed CLAIMED until its
    own lease expired, and could run again and be refused again. The commit now fires the deadline itself."""
    workflow, timer, passed = CASES[deadline]
    iid = await engine.client.start(workflow, {}, deadline=5 if deadline == "instance" else None)
    w.HOLD[iid], w.ENTERED[iid] = asyncio.Event(), asyncio.Event()
    alive = engine.new_worker(concurrency=1, lease_seconds=30, worker_id="alive")
    [claim] = await engine.store.claim(1, 30, "alive")
    segment = asyncio.create_task(alive._segment(claim))
    await asyncio.wait_for(w.ENTERED[iid].wait(), 30)  # the last (or the slow) step's handler runs
    await engine.move_clock(6)  # past the 5 s deadline
    [held] = await engine.store.claim(1, 1, "dead")  # the deadline's timer, by a worker that dies with it
    assert (held.instance.position, held.command.kind, held.command.name) == (SAGA, "TIMER", timer)
    await engine.move_clock(2)  # its lease has expired; the handler's lease (30 s) holds
    w.HOLD[iid].set()
    await segment
    assert alive.events.fenced == 1  # nothing of the step is written

    # That commit fired the deadline: the timer settled by it, the deadline's entry written.
    row = await conn.fetchrow("SELECT state, claimed_by, token FROM stepstone.commands WHERE id = $1",
                              held.command.id)
    assert (row["state"], row["claimed_by"], row["token"]) == ("COMPLETE", "alive", None)
    history = kinds(await engine.client.history(iid))
    assert history.count(passed) == 1, history
    assert await conn.fetchval("SELECT lease_token FROM stepstone.positions WHERE instance_id = $1 AND path = $2",
                               iid, SAGA) != held.token

    # The dead worker's late commit of the timer is fenced: it writes nothing.
    dead = engine.new_worker(concurrency=1, lease_seconds=1, worker_id="dead")
    await dead._segment(held)
    assert dead.events.fenced == 1
    assert kinds(await engine.client.history(iid)) == history

    await engine.run_until_idle()
    if deadline == "instance":
        ended = await assert_ended(engine, iid, "TIMED_OUT", ["book:None"], "DEADLINE_PASSED", "STEP_COMPENSATED",
                                   "INSTANCE_TIMED_OUT")
        assert "INSTANCE_COMPLETED" not in ended
        assert (await engine.client.get(iid)).state["log"] == ["book"]
    else:
        info = await engine.client.get(iid)
        assert (info.status, info.state["log"]) == ("COMPLETED", ["begin", "fallback"])
        k = kinds(await engine.client.history(iid))
        assert k.index(passed) < k.index("STEP_DEADLINE_EXCEEDED") < k.index("INSTANCE_COMPLETED"), k


async def test_a_signal_leaving_a_wait_takes_over_its_deadline_timer_a_dead_worker_holds(
    engine: Engine, conn: asyncpg.Connection
) -> None:
    """`patient` waits past its wait's 60 s deadline, whose timer a worker claimed and died with; then `go` is
    applied. Its commit parked the signal and gave the position back, but the deadline waited for the dead
    worker's lease to be taken over. Now that commit fires the deadline too: the wait goes to `fallback`."""
    iid = await engine.client.start(w.patient, {})
    await engine.new_worker(concurrency=1, lease_seconds=30).run_until_idle()
    assert (await engine.client.get(iid)).step == "linger"
    await engine.move_clock(61)
    [held] = await engine.store.claim(1, 1, "dead")
    assert (held.instance.position, held.command.name) == (SAGA, "step_deadline")
    await engine.client.signal(iid, "go")
    alive = engine.new_worker(concurrency=1, lease_seconds=30, worker_id="alive")
    [claim] = await engine.store.claim(1, 30, "alive")
    assert (claim.command.kind, claim.command.name) == ("SIGNAL", "go")
    await engine.move_clock(2)  # the dead worker's lease has expired; no claim has taken it over
    await alive._segment(claim)
    assert alive.events.fenced == 1
    assert await conn.fetchval("SELECT claimed_by FROM stepstone.commands WHERE id = $1 AND state = 'COMPLETE'",
                               held.command.id) == "alive"
    history = kinds(await engine.client.history(iid))
    assert history.count("STEP_DEADLINE_PASSED") == 1 and "SIGNAL_PARKED" in history, history

    dead = engine.new_worker(concurrency=1, lease_seconds=1, worker_id="dead")
    await dead._segment(held)
    assert dead.events.fenced == 1
    assert kinds(await engine.client.history(iid)) == history

    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.state["log"]) == ("COMPLETED", ["book", "fallback"])
    rows = await conn.fetch("SELECT state FROM stepstone.commands WHERE instance_id = $1 AND name = 'go'", iid)
    assert [r["state"] for r in rows] == ["REJECTED"]  # parked, then rejected as the instance ended
