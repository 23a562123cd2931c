"""Deadlines: a timer on the saga's own position; when it passes, the instance compensates what it
completed and ends TIMED_OUT. A handler still running then is a zombie: its commit writes nothing."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.core.model import FAILURE_KINDS
from stepstone.core.plan import END
from stepstone.core.saga import SAGA
from stepstone.errors import DefinitionError, InvalidInput, InvalidState
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.testing import Engine, open_engine
from tests._pg import until_shown
from tests.sagas import workflows as w
from tests.sagas.conftest import assert_ended, kinds
from tests.sagas.workflows import Trip


async def test_deadline_during_a_wait_compensates_and_times_out(engine: Engine, conn: asyncpg.Connection) -> None:
    iid = await engine.client.start(w.waiting, {})  # the workflow's default deadline: one hour
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.step) == ("WAITING", "hold_on")
    assert await conn.fetchval("SELECT deadline_at - created_at FROM stepstone.instances WHERE id = $1",
                               iid) == timedelta(hours=1)

    await engine.move_clock(timedelta(minutes=59))
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "WAITING"

    await engine.move_clock(timedelta(minutes=2))
    await engine.run_until_idle()
    await assert_ended(engine, iid, "TIMED_OUT", ["book:None"], "DEADLINE_PASSED", "STEP_COMPENSATED",
                       "INSTANCE_TIMED_OUT")
    assert (await engine.client.wait_for(iid, timeout=5)).status == "TIMED_OUT"
    # A signal that comes later is refused, as for any ended instance (migration 0044: it was recorded,
    # then rejected by the worker).
    with pytest.raises(InvalidState, match="TIMED_OUT"):
        await engine.client.signal(iid, "done")
    assert (await engine.client.get(iid)).status == "TIMED_OUT"


async def test_an_instance_that_ends_in_time_never_times_out(engine: Engine) -> None:
    iid = await engine.client.start(w.waiting, {}, deadline=timedelta(minutes=5))
    await engine.run_until_idle()
    await engine.client.signal(iid, "done")
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"
    await engine.move_clock(timedelta(minutes=10))
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"
    assert w.CALLS == []


NAIVE = datetime(2030, 1, 1)  # noqa: DTZ001 - the point: an instant without a zone


@pytest.mark.parametrize("deadline", [
    float("inf"), 1e300, datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=1))),
    datetime(9999, 12, 31, 23, 59, tzinfo=timezone(-timedelta(hours=1))), timedelta(days=365_251), -1.0, NAIVE,
    # These raised a bare ValueError or TypeError from float(), or were taken as seconds ("60", True).
    "soon", "60", [60], True, float("nan"),
])
async def test_a_deadline_out_of_range_is_refused_before_anything_is_stored(engine: Engine, deadline: Any) -> None:
    """The first four once reached the server, which refused the statement ("interval out of range", "date
    value out of range") with a driver error instead of the caller's InvalidInput; a thousand years and a
    day is just past the bound, which a thousand years is not."""
    with pytest.raises(InvalidInput, match="deadline") as refused:
        await engine.client.start(w.waiting, {}, deadline=deadline)
    assert refused.value.what == "deadline"
    assert await engine.client.list() == []
    assert await engine.client.start(w.waiting, {}, deadline=timedelta(days=365_250)) is not None  # a thousand years


async def test_deadline_during_a_running_handler_fences_it(engine: Engine, conn: asyncpg.Connection) -> None:
    iid = await engine.client.start(w.waiting, {}, deadline=5)
    await engine.run_until_idle()
    w.HOLD[iid], w.ENTERED[iid] = asyncio.Event(), asyncio.Event()
    await engine.client.signal(iid, "go")
    zombie = asyncio.create_task(engine.run_until_idle())
    await w.ENTERED[iid].wait()  # slow_step runs, holding the root position's lease

    await engine.move_clock(6)  # past the deadline, well inside the lease
    other = engine.new_worker(concurrency=2, lease_seconds=30)
    await other.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "TIMED_OUT"
    assert info.state["undone"] == ["book:None"]
    before = await conn.fetch("SELECT * FROM stepstone.history WHERE instance_id = $1 ORDER BY seq", iid)

    w.HOLD[iid].set()  # the zombie wakes up after the deadline fired: its commit is refused
    await zombie
    assert engine.worker.events.fenced == 1
    after = await conn.fetch("SELECT * FROM stepstone.history WHERE instance_id = $1 ORDER BY seq", iid)
    assert after == before
    info = await engine.client.get(iid)
    assert info.status == "TIMED_OUT"
    assert "slow" not in info.state["log"]
    assert [r["step"] for r in await engine.client.compensations(iid)] == ["book"]
    assert [c for _, c in w.CALLS] == ["book"]
    cancelled = [h for h in await engine.client.history(iid) if h["kind"] == "COMMAND_CANCELLED"]
    # The zombie's claimed command, settled once: the signal, whose step it was running (the signal and
    # the step it enters commit as one, core.folding, so nothing of the signal was committed).
    assert [h["data"]["kind"] for h in cancelled] == ["SIGNAL"]


@pytest.mark.parametrize("deadline", [0, timedelta(0), "held"])
async def test_a_deadline_that_passes_stops_steps_going_on_in_place(engine: Engine, deadline: Any) -> None:
    """At one slot a run of action steps goes on in place, never letting go of its position, so the
    deadline's timer waited for the run to end, which then rejected it unfired: the instance COMPLETED past
    its deadline. "held": the deadline passes while slow_step's handler runs (signalled from the wait), the
    run going on to `finish` after it; 0 and timedelta(0): passed before the first step."""
    one_slot = engine.new_worker(concurrency=1, lease_seconds=30)
    if deadline != "held":
        iid = await engine.client.start(w.linear, {}, deadline=deadline)
        await one_slot.run_until_idle()
        # The START is older than the deadline's timer (both due at the start): `one` runs, then the timer.
        await assert_ended(engine, iid, "TIMED_OUT", ["one:{'id': 'one-1'}"], "DEADLINE_PASSED",
                           "INSTANCE_TIMED_OUT")
        assert (await engine.client.get(iid)).state["log"] == ["one"]
        return
    iid = await engine.client.start(w.waiting, {}, deadline=5)
    await one_slot.run_until_idle()
    w.HOLD[iid], w.ENTERED[iid] = asyncio.Event(), asyncio.Event()
    await engine.client.signal(iid, "go")
    running = asyncio.create_task(one_slot.run_until_idle())
    await w.ENTERED[iid].wait()
    await engine.move_clock(6)  # past the deadline, well inside the lease
    w.HOLD[iid].set()
    await running
    await assert_ended(engine, iid, "TIMED_OUT", ["slow_step:None", "book:None"], "DEADLINE_PASSED",
                       "INSTANCE_TIMED_OUT")
    assert "finish" not in (await engine.client.get(iid)).state["log"]


async def _past_the_step_deadline(engine: Engine, workflow: object) -> str:
    """Start, hold `slow` in its handler, pass its 5 s deadline and let another worker act on it; then
    release the held handler, whose commit must be refused. Returns the instance id."""
    iid = await engine.client.start(workflow, {})  # type: ignore[arg-type]
    w.HOLD[iid], w.ENTERED[iid] = asyncio.Event(), asyncio.Event()
    held = asyncio.create_task(engine.run_until_idle())
    await w.ENTERED[iid].wait()
    await engine.move_clock(6)
    await engine.new_worker(concurrency=2, lease_seconds=30).run_until_idle()
    w.HOLD[iid].set()
    await held
    assert engine.worker.events.fenced == 1
    return iid


async def test_a_step_deadline_moves_to_its_declared_transition(engine: Engine) -> None:
    iid = await _past_the_step_deadline(engine, w.timely)
    info = await engine.client.get(iid)
    assert (info.status, info.state["log"]) == ("COMPLETED", ["begin", "fallback"])
    k = kinds(await engine.client.history(iid))
    assert k.index("STEP_DEADLINE_PASSED") < k.index("STEP_DEADLINE_EXCEEDED") < k.index("INSTANCE_COMPLETED")
    assert [h["step"] for h in await engine.client.history(iid) if h["kind"] == "STEP_COMPLETED"] == [
        "begin", "fallback"]


async def test_a_step_deadline_without_a_transition_fails_the_step(engine: Engine) -> None:
    iid = await _past_the_step_deadline(engine, w.strict)  # a saga: the failure compensates
    await assert_ended(engine, iid, "COMPENSATED", ["begin:None"], "STEP_DEADLINE_EXCEEDED", "STEP_COMPENSATED")
    assert (await engine.client.get(iid)).error["type"] == "StepDeadline"


@pytest.mark.parametrize("workflow", ["timely", "hasty"])
async def test_a_step_that_outlives_its_deadline_at_one_slot_goes_to_on_deadline(engine: Engine, workflow: str) -> None:
    """At one slot the step deadline's timer cannot be claimed while the held handler runs: its commit,
    after the deadline, went on to `on_time` and `fallback` never ran. The deadline wins: the late commit
    writes nothing of the step, the deadline interrupts it there, and `on_deadline` runs (hasty: the start
    step, whose START the commit would have gone on in)."""
    one_slot = engine.new_worker(concurrency=1, lease_seconds=30)
    iid = await engine.client.start(getattr(w, workflow), {})
    w.HOLD[iid], w.ENTERED[iid] = asyncio.Event(), asyncio.Event()
    running = asyncio.create_task(one_slot.run_until_idle())
    await w.ENTERED[iid].wait()
    await engine.move_clock(6)  # past the 5 s step deadline, well inside the lease
    w.HOLD[iid].set()
    await running
    info = await engine.client.get(iid)
    first = ["begin"] if workflow == "timely" else []
    assert (info.status, info.state["log"]) == ("COMPLETED", [*first, "fallback"])
    history = await engine.client.history(iid)
    k = kinds(history)
    assert k.index("STEP_DEADLINE_PASSED") < k.index("STEP_DEADLINE_EXCEEDED") < k.index("INSTANCE_COMPLETED")
    assert [h["step"] for h in history if h["kind"] == "STEP_COMPLETED"] == [*first, "fallback"]
    assert one_slot.events.fenced == 1


async def test_a_step_that_finishes_in_time_ignores_its_deadline(engine: Engine) -> None:
    iid = await engine.client.start(w.timely, {})
    await engine.run_until_idle()
    await engine.move_clock(10)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.state["log"]) == ("COMPLETED", ["begin", "slow", "on_time"])
    assert "STEP_DEADLINE_EXCEEDED" not in kinds(await engine.client.history(iid))


async def test_a_step_deadline_that_fires_after_its_step_was_left_records_nothing(
    engine: Engine, conn: asyncpg.Connection
) -> None:
    """begin commits in time and the instance waits on past begin's deadline, so the deadline's timer fires
    on a position that moved on: nothing happens, and the history says nothing either (it recorded
    STEP_DEADLINE_PASSED for a step that was left in time)."""
    iid = await engine.client.start(w.punctual, {})
    await engine.run_until_idle()
    await engine.advance(seconds=10)
    assert await conn.fetchval("SELECT state FROM stepstone.commands WHERE instance_id = $1 AND kind = 'TIMER' "
                               "AND name = 'step_deadline'", iid) == "COMPLETE"  # it fired
    assert (await engine.client.get(iid)).step == "linger"
    await engine.client.signal(iid, "go")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.state["log"]) == ("COMPLETED", ["begin", "on_time"])
    k = kinds(await engine.client.history(iid))
    assert not {"STEP_DEADLINE_PASSED", "STEP_DEADLINE_EXCEEDED"} & set(k), k


async def test_the_start_step_takes_a_deadline_and_its_late_commit_is_refused(engine: Engine) -> None:
    iid = await _past_the_step_deadline(engine, w.hasty)  # slow is the start step: its START is fenced
    info = await engine.client.get(iid)
    assert (info.status, info.state["log"]) == ("COMPLETED", ["fallback"])
    history = await engine.client.history(iid)
    assert [h["step"] for h in history if h["kind"] == "STEP_COMPLETED"] == ["fallback"]
    [cancelled] = [h for h in history if h["kind"] == "COMMAND_CANCELLED"]
    assert cancelled["data"]["kind"] == "START"  # the late handler's command, settled once


async def test_a_wait_that_outlasts_its_deadline_moves_to_on_deadline(engine: Engine, conn: asyncpg.Connection) -> None:
    iid = await engine.client.start(w.patient, {})
    await engine.run_until_idle()
    await engine.advance(seconds=59)
    assert (await engine.client.get(iid)).step == "linger"

    await engine.advance(seconds=2)
    info = await engine.client.get(iid)
    assert (info.status, info.state["log"]) == ("COMPLETED", ["book", "fallback"])
    k = kinds(await engine.client.history(iid))
    assert k.index("WAITING") < k.index("STEP_DEADLINE_EXCEEDED") < k.index("INSTANCE_COMPLETED")
    assert "WAIT_TIMED_OUT" not in k
    # The wait's own timeout was superseded when the deadline left the wait, not left to fire later.
    assert await conn.fetchval("SELECT state FROM stepstone.commands WHERE instance_id = $1 AND kind = 'TIMER' "
                               "AND name = 'timeout'", iid) == "SUPERSEDED"


async def test_a_wait_deadline_without_a_transition_fails_the_step(engine: Engine) -> None:
    iid = await engine.client.start(w.stubborn, {})  # a saga: the failure compensates book
    await engine.run_until_idle()
    await engine.advance(seconds=61)
    await assert_ended(engine, iid, "COMPENSATED", ["book:None"], "STEP_DEADLINE_EXCEEDED", "STEP_COMPENSATED")
    assert (await engine.client.get(iid)).error["type"] == "StepDeadline"


async def test_a_wait_left_in_time_ignores_its_deadline(engine: Engine) -> None:
    iid = await engine.client.start(w.patient, {})
    await engine.run_until_idle()
    await engine.client.signal(iid, "go")
    await engine.run_until_idle()
    await engine.advance(seconds=120)
    info = await engine.client.get(iid)
    assert (info.status, info.state["log"]) == ("COMPLETED", ["book", "finish"])
    assert "STEP_DEADLINE_EXCEEDED" not in kinds(await engine.client.history(iid))



def test_a_wait_deadline_is_checked_at_registration() -> None:
    negative: Workflow[Trip] = Workflow("negative", version=1, state=Trip)
    negative.wait("linger", signals={"go": END}, start=True, deadline=-1)
    with pytest.raises(DefinitionError, match="a deadline is for action, timer, wait steps and must not be negative"):
        Registry(negative)
    unknown: Workflow[Trip] = Workflow("unknown", version=1, state=Trip)
    unknown.wait("linger", signals={"go": END}, start=True, deadline=5, on_deadline="nowhere")
    with pytest.raises(DefinitionError, match="goes to unknown step 'nowhere'"):
        Registry(unknown)


async def test_a_timer_bounded_by_a_deadline_leaves_early(engine: Engine, conn: asyncpg.Connection) -> None:
    iid = await engine.client.start(w.sleepy, {})  # the timer is the start step: the start enters it
    await engine.run_until_idle()
    await engine.advance(seconds=61)
    info = await engine.client.get(iid)
    assert (info.status, info.state["log"]) == ("COMPLETED", ["fallback"])
    assert await conn.fetchval("SELECT state FROM stepstone.commands WHERE instance_id = $1 AND kind = 'TIMER' "
                               "AND name = 'fire'", iid) == "SUPERSEDED"
    deadlines = await conn.fetchval("SELECT count(*) FROM stepstone.commands WHERE instance_id = $1 AND kind = 'TIMER' "
                                    "AND name = 'step_deadline' AND position = '$saga'", iid)
    assert deadlines == 1  # entered once: one deadline timer


GUIDE = (Path(__file__).resolve().parents[2] / "docs" / "sagas.md").read_text(encoding="utf-8")


async def test_the_guides_step_deadline_example_runs(database_url: str) -> None:
    guide, fence = GUIDE, "`" * 3
    start = guide.index('wf = Workflow("shipping")')
    source = guide[guide.rindex(fence + "python\n", 0, start) + len(fence + "python\n"):guide.index(fence, start)]
    scope: dict[str, Any] = {}
    exec(compile(source, "docs/sagas.md", "exec"), scope)  # noqa: S102 - the guide's own example
    async with open_engine(database_url, Registry(scope["wf"])) as shipping:
        iid = await shipping.client.start(scope["wf"], {})
        await shipping.run_until_idle()
        assert (await shipping.client.get(iid)).step == "await_pickup"
        await shipping.advance(days=3)  # nobody picked it up within two days
        info = await shipping.client.get(iid)
        assert (info.status, info.state) == ("COMPLETED", {"label": "L-1", "later": True})


async def test_signal_with_start_gives_the_instance_its_deadlines(engine: Engine, conn: asyncpg.Connection) -> None:
    # The instance it starts has the workflow's deadline and its start step's, as a plain start gives them.
    started = await engine.client.start_or_signal(w.waiting, "trip-1", "go")
    assert started.started
    assert await conn.fetchval("SELECT deadline_at - created_at FROM stepstone.instances WHERE id = $1",
                               started.instance_id) == timedelta(hours=1)
    eager: Workflow[Trip] = Workflow("eager_signal", version=1, state=Trip)
    eager.step(w.book, name="book", start=True, next="linger", deadline=60)
    eager.wait("linger", signals={"go": END})
    lingering = await engine.client.start_or_signal(eager, "trip-2", "go")
    step_deadline = await conn.fetchval(
        "SELECT c.available_at - i.created_at FROM stepstone.commands c JOIN stepstone.instances i "
        "ON i.id = c.instance_id WHERE c.instance_id = $1 AND c.kind = 'TIMER' AND c.name = 'step_deadline'",
        lingering.instance_id)
    assert step_deadline == timedelta(seconds=60)
    again = await engine.client.start_or_signal(w.waiting, "trip-1", "done")  # signalled, not started again
    assert (again.instance_id, again.started) == (started.instance_id, False)
    assert await conn.fetchval("SELECT count(*) FROM stepstone.commands WHERE instance_id = $1 AND name = 'deadline'",
                               started.instance_id) == 1



async def test_every_failures_only_view_shows_the_same_entries(engine: Engine) -> None:
    """The CLI's `history --failed` (Operations), the API's `failed_only` and the UI's "Failures only"
    (the management store) each had their own idea of a failure: the first listed five kinds and left
    the deadlines and a failed compensation attempt out, the others matched any kind naming FAIL or DEAD.
    Now one list, core.model.FAILURE_KINDS, for all of them."""
    from stepstone.ops import Operations  # noqa: PLC0415 - only this test reads the operator's views
    from stepstone.store.management import open_management  # noqa: PLC0415

    iid = await _past_the_step_deadline(engine, w.strict)
    everything = kinds(await engine.client.history(iid))
    expected = [k for k in everything if k in FAILURE_KINDS]
    # (A saga that begins compensating never is FAILED: no INSTANCE_FAILED, tests/sagas/test_compensation.py.)
    assert {"STEP_DEADLINE_PASSED", "STEP_DEADLINE_EXCEEDED"} <= set(expected), everything
    operations = await Operations.on(engine.store).history(iid, failed_only=True)
    assert [e.kind for e in operations.entries] == expected
    management = open_management(engine.store)
    rows = await management.history_page(iid, after=0, limit=100, failed_only=True)
    assert [r["kind"] for r in rows] == expected


_leg: Workflow[dict[str, Any]] = Workflow("timed_leg", deadline=600)


@_leg.step(start=True, next="hold", deadline=60)
def _book_leg(ctx: StepContext, state: dict[str, Any]) -> None:
    ctx.record("seat")


_leg.wait("hold", signals={"go": _leg.end()})
_journey: Workflow[dict[str, Any]] = Workflow("journey")


@_journey.child(workflow="timed_leg", next="_arrive", start=True)
def _spawn(ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
    return {}


@_journey.step(next=None)
def _arrive(ctx: StepContext, state: dict[str, Any]) -> None:
    state["arrived"] = True


async def test_a_child_gets_its_workflows_deadlines_as_a_start_does(
    database_url: str, conn: asyncpg.Connection,
) -> None:
    """A child step's child never timed out: its start (in the parent's commit) gave it neither its
    workflow's default deadline nor its action start step's deadline, which `client.start` gives."""
    async with open_engine(database_url, Registry(_leg, _journey)) as engine:
        parent = await engine.client.start(_journey, {})
        await engine.run_until_idle()
        child = str(await conn.fetchval("SELECT id FROM stepstone.instances WHERE parent_id = $1", parent))
        timers = await conn.fetch(  # counted from the child's start, in its parent's commit
            "SELECT t.name, t.available_at - i.created_at AS after FROM stepstone.commands t "
            "JOIN stepstone.instances i ON i.id = t.instance_id "
            "WHERE t.instance_id = $1 AND t.kind = 'TIMER' ORDER BY t.id", uuid.UUID(child))
        assert [(t["name"], round(t["after"].total_seconds())) for t in timers] == [
            ("deadline", 600), ("step_deadline", 60)]
        await engine.advance(minutes=11)
        assert (await engine.client.get(child)).status == "TIMED_OUT"
        assert (await engine.client.get(parent)).status == "FAILED"  # its child ended TIMED_OUT


class _HoldsTheDeadline(Worker):
    """A worker whose deadline commit (on `$saga`) waits, once decided, until the test lets it go: its
    timer is CLAIMED meanwhile."""

    decided: asyncio.Event
    release: asyncio.Event

    async def _commit(self, claim: Any, command_id: int, decision: Any, visit: int, state_version: int) -> Any:
        if claim.instance.position == SAGA:
            self.decided.set()
            await self.release.wait()
        return await super()._commit(claim, command_id, decision, visit, state_version)


class _CommitOrder(_HoldsTheDeadline):
    """A worker whose root commit waits until its deadline segment (on `$saga`) has decided, and whose
    deadline commit waits until the test lets it go: the deadline was decided on an instance still
    waiting, and its commit comes after the root's commit ended the instance."""

    async def _commit(self, claim: Any, command_id: int, decision: Any, visit: int, state_version: int) -> Any:
        if claim.instance.position != SAGA:
            await self.decided.wait()
        return await super()._commit(claim, command_id, decision, visit, state_version)


async def test_a_deadline_decided_before_its_instance_completed_does_not_reopen_it(
    engine: Engine, conn: asyncpg.Connection
) -> None:
    # Seen under kills (tests/chaos/test_deadline_kills.py): a worker claimed an instance's deadline timer
    # while the instance ran its last step; that step's commit completed the instance, then the deadline's
    # commit (fenced on the saga position, whose lease it held) compensated the completed instance and
    # ended it TIMED_OUT, after INSTANCE_COMPLETED.
    iid = await engine.client.start(w.waiting, {}, deadline=5)
    await engine.run_until_idle()
    await engine.client.signal(iid, "done")  # finish, the last step, is now claimable
    await engine.move_clock(6)  # and so is the deadline
    # The root's commit must come in time, its clock reading before deadline_at, while the deadline's claim
    # reads it after (a commit whose transaction began just before the deadline, committing after the claim).
    # One test clock cannot split them: the deadline's instant moves on, its timer stays due. (A commit that
    # reads the deadline passed does not end the instance, migration 0061.)
    await conn.execute("UPDATE stepstone.instances SET deadline_at = deadline_at + interval '1 minute' "
                       "WHERE id = $1", iid)
    worker = _CommitOrder(engine.store, engine.worker.registry, WorkerConfig(concurrency=2, lease_seconds=30),
                          engine.worker.limits)
    worker.decided, worker.release = asyncio.Event(), asyncio.Event()
    running = asyncio.create_task(worker.run_until_idle())
    try:
        await until_shown(conn, "SELECT status = 'COMPLETED' FROM stepstone.instances WHERE id = $1", iid)
    finally:
        worker.release.set()
        await running
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    history = kinds(await engine.client.history(iid))
    assert (info.status, info.state["undone"]) == ("COMPLETED", []), history
    assert history[-1] == "INSTANCE_COMPLETED", history
    assert "DEADLINE_PASSED" not in history
    assert w.CALLS == []
    assert await conn.fetchval("SELECT state FROM stepstone.commands WHERE instance_id = $1 AND name = 'deadline'",
                               iid) != "COMPLETE"


@pytest.mark.parametrize("timer", ["unclaimed", "held"])
async def test_a_last_step_that_outlives_the_instances_deadline_at_one_slot_times_it_out(
    engine: Engine, conn: asyncpg.Connection, timer: str
) -> None:
    """At one slot the instance deadline's timer cannot be claimed while the last step's handler runs: its
    commit, after the deadline, completed the instance, and the timer, claimed later, was settled STALE on
    it. The deadline wins: the late commit writes nothing of the step and the instance times out, as if
    the timer had fired just before. "unclaimed": that commit fires the deadline itself; "held": another
    worker has claimed the timer, so the commit is refused and that worker's commit times the instance out."""
    one_slot = engine.new_worker(concurrency=1, lease_seconds=30)
    iid = await engine.client.start(w.tardy, {}, deadline=5)
    w.HOLD[iid], w.ENTERED[iid] = asyncio.Event(), asyncio.Event()
    running = asyncio.create_task(one_slot.run_until_idle())
    await w.ENTERED[iid].wait()  # last_word runs, after book committed
    await engine.move_clock(6)  # past the 5 s deadline, well inside the lease
    if timer == "held":
        other = _HoldsTheDeadline(engine.store, engine.worker.registry,
                                  WorkerConfig(concurrency=2, lease_seconds=30), engine.worker.limits)
        other.decided, other.release = asyncio.Event(), asyncio.Event()
        deadline = asyncio.create_task(other.run_until_idle())
        await other.decided.wait()
    w.HOLD[iid].set()
    await running
    assert one_slot.events.fenced == 1
    if timer == "held":
        assert (await engine.client.get(iid)).status == "RUNNING"  # refused: nothing written
        other.release.set()
        await deadline
    await engine.run_until_idle()
    history = await assert_ended(engine, iid, "TIMED_OUT", ["book:None"], "DEADLINE_PASSED", "STEP_COMPENSATED",
                                 "INSTANCE_TIMED_OUT")
    assert "INSTANCE_COMPLETED" not in history
    assert (await engine.client.get(iid)).state["log"] == ["book"]  # last_word's change was not written
    entries = await engine.client.history(iid)
    assert [h["step"] for h in entries if h["kind"] == "STEP_COMPLETED"] == ["book"]
    # last_word's command, settled once: the START, gone on in place from book to last_word
    assert [h["data"]["kind"] for h in entries if h["kind"] == "COMMAND_CANCELLED"] == ["START"]
    row = await conn.fetchrow(
        "SELECT i.ended_at >= i.deadline_at AS late, c.state FROM stepstone.instances i JOIN stepstone.commands c "
        "ON c.instance_id = i.id AND c.name = 'deadline' WHERE i.id = $1", iid)
    assert (row["late"], row["state"]) == (True, "COMPLETE")  # the deadline's timer fired, once


async def _one_slot_held_past(engine: Engine, seconds: float, then: Any = None) -> Worker:
    """A worker of one slot, held by another instance's handler (tardy's last_word) while the clock moves
    `seconds` on; `then()` runs before the handler returns. Returns the worker, idle."""
    one_slot = engine.new_worker(concurrency=1, lease_seconds=30)
    holder = await engine.client.start(w.tardy, {})
    w.HOLD[holder], w.ENTERED[holder] = asyncio.Event(), asyncio.Event()
    running = asyncio.create_task(one_slot.run_until_idle())
    await w.ENTERED[holder].wait()
    await engine.move_clock(seconds)
    if then is not None:
        await then()
    w.HOLD[holder].set()
    await running
    return one_slot


async def _left_by_the_deadline(engine: Engine, conn: asyncpg.Connection, iid: str, name: str,
                                settled: tuple[str, str]) -> list[str]:
    """The wait went to on_deadline, and the command `name` that came after its deadline ended `settled`."""
    info = await engine.client.get(iid)
    assert (info.status, info.state["log"]) == ("COMPLETED", ["book", "fallback"])
    k = kinds(await engine.client.history(iid))
    assert k.index("STEP_DEADLINE_PASSED") < k.index("STEP_DEADLINE_EXCEEDED") < k.index("INSTANCE_COMPLETED"), k
    assert "SIGNAL_APPLIED" not in k and "WAIT_TIMED_OUT" not in k, k
    rows = await conn.fetch("SELECT state, last_error FROM stepstone.commands WHERE instance_id = $1 AND name = $2",
                            iid, name)
    assert [(r["state"], r["last_error"]) for r in rows] == [settled]
    return k


async def _parked_then_rejected(engine: Engine, conn: asyncpg.Connection, iid: str) -> None:
    """`go` was parked as the deadline had left the wait, and rejected when the instance ended (the rule for a
    signal applied to a wait already left, docs/messages.md)."""
    await _left_by_the_deadline(engine, conn, iid, "go", ("REJECTED", "INSTANCE_ENDED"))
    history = await engine.client.history(iid)
    [parked] = [h for h in history if h["kind"] == "SIGNAL_PARKED"]
    assert parked["data"] == {"signal": "go", "reason": "STEP_DEADLINE_PASSED"}
    assert parked["seq"] < next(h["seq"] for h in history if h["kind"] == "STEP_DEADLINE_EXCEEDED")


async def test_a_signal_that_comes_after_its_waits_deadline_at_one_slot_is_parked(
    engine: Engine, conn: asyncpg.Connection
) -> None:
    """`patient` waits on a one-slot worker held by another instance while the clock passes the wait's 60 s
    deadline; then `go` is sent. The deadline's timer, claimed first, queued its TIMER on the position behind
    the signal, and the wait took the signal as if in time: `finish`, not `fallback`. The deadline wins: the
    signal is parked (kept for a later wait that takes it), and the wait goes to `fallback`."""
    iid = await engine.client.start(w.patient, {})
    one_slot = engine.new_worker(concurrency=1, lease_seconds=30)
    await one_slot.run_until_idle()
    assert (await engine.client.get(iid)).step == "linger"

    async def go() -> None:
        await engine.client.signal(iid, "go")

    one_slot = await _one_slot_held_past(engine, 61, go)
    await _parked_then_rejected(engine, conn, iid)
    assert one_slot.events.fenced == 1


async def test_a_signal_whose_folded_step_commits_after_its_waits_deadline_is_parked(
    engine: Engine, conn: asyncpg.Connection
) -> None:
    """At one slot `go` is applied to `wary`'s wait in time, and the step it enters (dawdle, held) runs in the
    same segment, its commit the signal's too (core.folding); it returns after the wait's deadline, whose
    timer no slot was free to claim. The commit went on to `dawdle`'s next step. The deadline wins there."""
    one_slot = engine.new_worker(concurrency=1, lease_seconds=30)
    iid = await engine.client.start(w.wary, {})
    await one_slot.run_until_idle()
    await engine.client.signal(iid, "go")
    w.HOLD[iid], w.ENTERED[iid] = asyncio.Event(), asyncio.Event()
    running = asyncio.create_task(one_slot.run_until_idle())
    await w.ENTERED[iid].wait()  # dawdle's handler runs: the signal is claimed, nothing committed
    await engine.move_clock(61)
    w.HOLD[iid].set()
    await running
    await _parked_then_rejected(engine, conn, iid)
    assert one_slot.events.fenced == 1


async def test_a_timeout_applied_after_its_waits_deadline_at_one_slot_gives_way_to_it(
    engine: Engine, conn: asyncpg.Connection
) -> None:
    """`hurried`'s wait times out at 30 s and its deadline is at 60 s; its one-slot worker is held until 61 s.
    The timeout, the older, was claimed first and left the wait for `finish` after the deadline had passed.
    The deadline wins: the timeout is settled STALE and the wait goes to `fallback`."""
    one_slot = engine.new_worker(concurrency=1, lease_seconds=30)
    iid = await engine.client.start(w.hurried, {})
    await one_slot.run_until_idle()
    one_slot = await _one_slot_held_past(engine, 61)
    await _left_by_the_deadline(engine, conn, iid, "timeout", ("STALE", "STEP_DEADLINE_PASSED"))
    assert one_slot.events.fenced == 1


async def test_a_signal_that_comes_while_a_worker_fires_its_waits_deadline_is_parked(
    engine: Engine, conn: asyncpg.Connection
) -> None:
    """`patient`'s wait deadline has passed and another worker holds its timer (decided, not committed) when `go`
    is applied: the signal's commit went on to `finish`, and the timer's, coming after, found the wait left. The
    deadline wins: the signal's commit parks it and writes nothing else, and the timer's commit interrupts the
    wait."""
    iid = await engine.client.start(w.patient, {})
    await engine.run_until_idle()
    await engine.move_clock(61)
    other = _HoldsTheDeadline(engine.store, engine.worker.registry, WorkerConfig(concurrency=2, lease_seconds=30),
                              engine.worker.limits)
    other.decided, other.release = asyncio.Event(), asyncio.Event()
    deadline = asyncio.create_task(other.run_until_idle())
    await other.decided.wait()
    await engine.client.signal(iid, "go")
    signalled = engine.new_worker(concurrency=1, lease_seconds=30)
    await signalled.run_until_idle()
    assert signalled.events.fenced == 1
    assert (await engine.client.get(iid)).step == "linger"  # nothing of the signal written
    other.release.set()
    await deadline
    await engine.run_until_idle()
    await _parked_then_rejected(engine, conn, iid)
