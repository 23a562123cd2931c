"""Cancel settles every open command in ascending id order, one history entry each (who and why);
cancel(compensate=True) compensates first; cancelling an ended instance is a typed no-op."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import asyncpg
import pytest

from stepstone.client import Cancellation
from stepstone.errors import ChildNotAwaited
from stepstone.store.port import CommitRequest
from stepstone.testing import Engine
from tests.sagas import workflows as w
from tests.sagas.conftest import assert_ended

_OPEN = ("PENDING", "DEFERRED", "CLAIMED", "PARKED", "DEAD")


async def test_cancel_settles_every_kind_of_open_command(engine: Engine, conn: asyncpg.Connection) -> None:
    engine.client.actor = "ops:alice"
    iid = await engine.client.start(w.plain, {})
    await engine.run_until_idle()  # two branches wait; spread/t has its timeout timer
    await engine.client.signal(iid, "go")  # the root waits at the join, not for a signal: PARKED
    await engine.run_until_idle()
    await engine.client.signal(iid, "go", position="spread/w")
    [claim] = await engine.store.claim(1, 30, "busy-worker")  # CLAIMED, its handler "running"
    await engine.client.signal(iid, "go", position="spread/w")  # PENDING behind it
    deferred = await engine.client.signal(iid, "go", position="spread/t")
    await conn.execute("UPDATE stepstone.commands SET state = 'DEFERRED', available_at = available_at + "
                       "interval '1 hour' WHERE id = $1", deferred)
    dead = await engine.client.signal(iid, "go", position="spread/t")
    await conn.execute("UPDATE stepstone.commands SET state = 'DEAD' WHERE id = $1", dead)
    open_before = await conn.fetch("SELECT id, kind, state FROM stepstone.commands WHERE instance_id = $1 "
                                   "AND state = ANY($2) ORDER BY id", iid, list(_OPEN))
    assert {r["state"] for r in open_before} == set(_OPEN)
    assert "TIMER" in {r["kind"] for r in open_before}

    result = await engine.client.cancellation(iid, "customer asked")
    assert result == Cancellation(iid, "cancelled", "CANCELLED")
    history = await engine.client.history(iid)
    entries = [h for h in history if h["kind"] == "COMMAND_CANCELLED"]
    assert [h["command_id"] for h in entries] == [r["id"] for r in open_before]
    assert [h["seq"] for h in entries] == sorted(h["seq"] for h in entries)
    assert [h["data"]["was"] for h in entries] == [r["state"] for r in open_before]
    assert {(h["actor"], h["data"]["reason"]) for h in entries} == {("ops:alice", "customer asked")}
    last = history[-1]
    assert (last["kind"], last["actor"], last["data"]["reason"], last["data"]["commands_cancelled"]) == (
        "INSTANCE_CANCELLED", "ops:alice", "customer asked", len(open_before))
    assert await conn.fetchval("SELECT count(*) FROM stepstone.commands WHERE instance_id = $1 AND state = ANY($2)",
                               iid, list(_OPEN)) == 0
    # The handler that was running commits nothing.
    from stepstone.core.model import Decision, Settle  # noqa: PLC0415 - only this check needs them
    assert await engine.store.commit(CommitRequest(claim, claim.command.id, Decision(Settle("COMPLETE")), 1),
                                     lease_seconds=30, worker="busy-worker") is None

    again = await engine.client.cancellation(iid, "twice")
    assert again == Cancellation(iid, "unchanged", "CANCELLED")
    assert not again.changed
    assert len(await engine.client.history(iid)) == len(history)


async def test_cancel_with_compensation_compensates_then_cancels(engine: Engine) -> None:
    iid = await engine.client.start(w.waiting, {})
    await engine.run_until_idle()
    result = await engine.client.cancellation(iid, "trip called off", compensate=True)
    assert result == Cancellation(iid, "compensating", "COMPENSATING")
    assert (await engine.client.cancellation(iid, "again", compensate=True)).outcome == "unchanged"
    await engine.run_until_idle()
    k = await assert_ended(engine, iid, "CANCELLED", ["book:None"],
                           "CANCEL_REQUESTED", "COMMAND_CANCELLED", "STEP_COMPENSATED")
    assert k[-1] == "INSTANCE_CANCELLED"
    # The deadline timer was settled with the rest: it never fires.
    await engine.move_clock(timedelta(hours=2))
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "CANCELLED"


async def test_cancelling_a_completed_instance_is_a_no_op(engine: Engine) -> None:
    iid = await engine.client.start(w.linear, {})
    await engine.run_until_idle()
    for compensate in (False, True):
        assert await engine.client.cancellation(iid, compensate=compensate) == Cancellation(
            iid, "unchanged", "COMPLETED")
    assert await engine.client.cancel(iid) == "COMPLETED"
    assert w.CALLS == []


async def test_a_worker_that_lost_its_lease_never_runs_a_compensation(engine: Engine) -> None:
    iid = await engine.client.start(w.waiting, {})
    await engine.run_until_idle()
    await engine.client.cancellation(iid, "stop", compensate=True)
    [claim] = await engine.store.claim(1, 30, "zombie")
    assert claim.command.kind == "COMPENSATE"
    zombie = engine.new_worker(concurrency=1, lease_seconds=30)

    await engine.move_clock(31)  # its lease expired; nobody has taken it over yet
    await zombie._segment(claim)
    assert w.CALLS == []
    assert zombie.events.fenced == 1

    await engine.run_until_idle()  # another worker takes the compensation over
    assert [c for _, c in w.CALLS] == ["book"]
    await zombie._segment(claim)
    assert [c for _, c in w.CALLS] == ["book"]
    assert (await engine.client.get(iid)).status == "CANCELLED"


def test_the_saga_guide_shows_the_booking_example_verbatim() -> None:
    root = Path(__file__).resolve().parents[2]
    guide = (root / "docs" / "sagas.md").read_text(encoding="utf-8")
    source = (root / "src" / "stepstone" / "examples" / "booking.py").read_text(encoding="utf-8")
    assert f"```python\n{source}```" in guide, "docs/sagas.md must contain examples/booking.py unchanged"


async def test_cancel_takes_the_children_that_go_with_their_parent_and_leaves_detached_ones(
    engine: Engine,
) -> None:
    iid = await engine.client.start(w.policies, {})
    await engine.run_until_idle()  # both children wait for "go"
    children = {c["position"]: c["id"] for c in (await engine.client.get(iid)).children}
    children = {"kid": children["split/a"], "loose": children["split/b"]}

    assert await engine.client.cancel(iid, "stop") == "CANCELLED"
    assert (await engine.client.get(children["kid"])).status == "CANCELLED"
    assert (await engine.client.get(children["loose"])).status == "WAITING"  # detached: it goes on alone
    await engine.client.signal(children["loose"], "go")
    await engine.run_until_idle()
    assert (await engine.client.get(children["loose"])).status == "COMPLETED"
    assert (await engine.client.get(iid)).status == "CANCELLED"


async def test_cancelling_an_instance_that_ended_any_way_is_a_no_op(engine: Engine) -> None:
    compensated = await engine.client.start(w.linear, {})
    w.FAIL[(compensated, "three")] = -1
    timed_out = await engine.client.start(w.waiting, {}, deadline=5)
    await engine.run_until_idle()
    await engine.advance(seconds=6)
    for iid, status in ((compensated, "COMPENSATED"), (timed_out, "TIMED_OUT")):
        before = await engine.client.history(iid)
        for compensate in (False, True):
            assert await engine.client.cancellation(iid, "late", compensate=compensate) == Cancellation(
                iid, "unchanged", status)
        assert await engine.client.history(iid) == before


async def test_a_detached_child_of_a_parent_whose_compensation_stopped_is_retried_as_its_own(engine: Engine) -> None:
    """The parent was cancelled with compensation, which stopped (COMPENSATION_FAILED); its detached child
    failed meanwhile. Neither the cancel nor the compensation touches that child, and nothing of the parent
    takes its result (its child step was cancelled): it is retried as an instance of its own, as once the
    parent has ended, and its report is ignored by the parent, which then compensates and ends as before."""
    iid = await engine.client.start(w.loosening, {})
    await engine.run_until_idle()
    [cid] = [str(c["id"]) for c in (await engine.client.get(iid)).children]
    w.FAIL[(iid, "undo_home")] = -1
    assert await engine.client.cancel(iid, "stop", compensate=True) == "COMPENSATING"
    await engine.run_until_idle()
    w.FAIL[(cid, "brittle_work")] = -1
    await engine.client.signal(cid, "go")
    await engine.run_until_idle()
    assert ((await engine.client.get(iid)).status, (await engine.client.get(cid)).status) == (
        "COMPENSATION_FAILED", "FAILED")
    del w.FAIL[(cid, "brittle_work")]

    await engine.client.retry(cid)
    await engine.run_until_idle()
    assert ((await engine.client.get(iid)).status, (await engine.client.get(cid)).status) == (
        "COMPENSATION_FAILED", "COMPLETED")
    del w.FAIL[(iid, "undo_home")]
    await engine.client.retry(iid)
    await engine.run_until_idle()
    await assert_ended(engine, iid, "CANCELLED", ["home:h"], "CANCEL_REQUESTED", "COMPENSATION_FAILED",
                       "CALLBACK_IGNORED", "INSTANCE_RETRIED", "STEP_COMPENSATED")


async def test_a_detached_child_whose_failure_took_its_parent_into_compensation_is_not_retried(
    engine: Engine,
) -> None:
    """Detached or not, a child whose failure its parent took (it failed at the child step, and compensated)
    is not awaited: a retry would run it for a result nothing takes."""
    iid = await engine.client.start(w.loosening, {})
    await engine.run_until_idle()
    [cid] = [str(c["id"]) for c in (await engine.client.get(iid)).children]
    w.FAIL[(cid, "brittle_work")] = 1
    await engine.client.signal(cid, "go")
    await engine.run_until_idle()
    assert ((await engine.client.get(iid)).status, (await engine.client.get(cid)).status) == ("COMPENSATED", "FAILED")
    with pytest.raises(ChildNotAwaited):
        await engine.client.retry(cid)
    assert (await engine.client.get(cid)).status == "FAILED"
