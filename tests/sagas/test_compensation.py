"""Compensation: reverse order of completion, retries under the compensation's own policy with every
attempt in the history, exhaustion (COMPENSATION_FAILED, the alert once, the outbox event once), and
an operator's retry resuming where it stopped."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import asyncpg
import pytest
from pydantic import BaseModel, model_validator

from stepstone import CompensationContext, Registry, Retry, StepContext, Workflow
from stepstone.core.failures import without_frames
from stepstone.errors import InvalidState
from stepstone.testing import Engine, open_engine
from tests.sagas import workflows as w
from tests.sagas.conftest import ALERTS, kinds


async def test_a_failed_step_compensates_the_completed_ones_in_reverse(
    engine: Engine, conn: asyncpg.Connection
) -> None:
    iid = await engine.client.start(w.linear, {"trip": "x"})
    w.FAIL[(iid, "three")] = -1
    await engine.run_until_idle()

    info = await engine.client.get(iid)
    assert info.status == "COMPENSATED"
    assert info.state["undone"] == ["two:two-1", "one:{'id': 'one-1'}"]
    assert [c for _, c in w.CALLS] == ["two", "one"]
    history = await engine.client.history(iid)
    k = kinds(history)
    assert k.index("STEP_FAILED") < k.index("COMPENSATION_STARTED") < k.index("STEP_COMPENSATED")
    # It never was FAILED: no INSTANCE_FAILED (it was written before COMPENSATION_STARTED); the error is
    # COMPENSATION_STARTED's, as its STEP_FAILED's.
    assert "INSTANCE_FAILED" not in k
    [started] = [h for h in history if h["kind"] == "COMPENSATION_STARTED"]
    assert started["data"]["cause"] == "failed" and started["data"]["error"]["step"] == "three"
    compensated = [h["step"] for h in history if h["kind"] == "STEP_COMPENSATED"]
    assert compensated == ["two", "one"]
    assert k[-1] == "INSTANCE_COMPENSATED"
    assert history[-1]["data"] == {"cause": "failed", "compensated": ["two", "one"]}
    rows = await engine.client.compensations(iid)
    assert [(r["step"], r["status"], r["attempts"]) for r in rows] == [("one", "COMPENSATED", 1),
                                                                        ("two", "COMPENSATED", 1)]
    # The compensation's event went out in its commit; nothing is left open.
    assert await conn.fetchval("SELECT count(*) FROM stepstone.outbox WHERE type = 'two.undone'") == 1
    assert await conn.fetchval("SELECT count(*) FROM stepstone.commands WHERE instance_id = $1 AND state IN "
                             "('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED', 'DEAD')", iid) == 0
    assert (await engine.client.wait_for(iid, timeout=5)).status == "COMPENSATED"


async def test_a_saga_that_completes_keeps_its_records_and_compensates_nothing(engine: Engine) -> None:
    iid = await engine.client.start(w.linear, {})
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"
    assert [r["status"] for r in await engine.client.compensations(iid)] == ["PENDING", "PENDING"]
    assert w.CALLS == []


async def test_a_compensation_that_fails_twice_then_succeeds(engine: Engine) -> None:
    iid = await engine.client.start(w.linear, {})
    w.FAIL[(iid, "three")] = -1
    w.FAIL[(iid, "undo_one")] = 2
    await engine.run_until_idle()

    assert (await engine.client.get(iid)).status == "COMPENSATED"
    history = await engine.client.history(iid)
    attempts = [(h["kind"], h["data"]["attempt"]) for h in history
                if h["kind"] in ("COMPENSATION_ATTEMPT_FAILED", "STEP_COMPENSATED") and h["step"] == "one"]
    assert attempts == [("COMPENSATION_ATTEMPT_FAILED", 1), ("COMPENSATION_ATTEMPT_FAILED", 2),
                        ("STEP_COMPENSATED", 3)]
    assert [c for _, c in w.CALLS] == ["two", "one", "one", "one"]
    assert ALERTS == []
    one = next(r for r in await engine.client.compensations(iid) if r["step"] == "one")
    assert (one["status"], one["attempts"]) == ("COMPENSATED", 3)


async def test_exhaustion_alerts_once_and_retry_resumes_where_it_stopped(
    engine: Engine, conn: asyncpg.Connection
) -> None:
    iid = await engine.client.start(w.linear, {})
    w.FAIL[(iid, "three")] = -1
    w.FAIL[(iid, "undo_one")] = -1
    await engine.run_until_idle()

    info = await engine.client.get(iid)
    assert info.status == "COMPENSATION_FAILED"
    assert info.error["type"] == "CompensationFailed"
    assert info.state["undone"] == ["two:two-1"]
    assert len(ALERTS) == 1
    alert = ALERTS[0]
    assert {k: alert[k] for k in ("instance_id", "workflow", "step", "compensation", "attempts")} == {
        "instance_id": iid, "workflow": "linear", "step": "one", "compensation": "undo_one", "attempts": 3}
    assert without_frames(alert)["last_error"] == {"type": "Boom", "message": "undo_one is down"}
    assert alert["last_error"]["frames"][-1]["function"] == "_maybe_fail"  # where the compensation raised
    events = await conn.fetch("SELECT payload FROM stepstone.outbox WHERE type = 'stepstone.compensation_failed'")
    assert len(events) == 1
    assert (await engine.client.wait_for(iid, timeout=5)).status == "COMPENSATION_FAILED"

    # The operator fixes the cause and retries: only the one given up runs again.
    w.FAIL.pop((iid, "undo_one"))
    w.CALLS.clear()
    await engine.client.retry(iid)
    assert (await engine.client.get(iid)).status == "COMPENSATING"
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPENSATED"
    assert info.state["undone"] == ["two:two-1", "one:{'id': 'one-1'}"]
    assert [c for c in w.CALLS] == [(iid, "one")]  # noqa: C416 - a copy, compared by value
    assert "INSTANCE_RETRIED" in kinds(await engine.client.history(iid))
    assert len(ALERTS) == 1


async def test_two_workers_racing_raise_the_alert_once(engine: Engine, conn: asyncpg.Connection) -> None:
    ids = []
    for _ in range(6):
        iid = await engine.client.start(w.linear, {})
        w.FAIL[(iid, "three")] = -1
        w.FAIL[(iid, "undo_one")] = -1
        ids.append(iid)
    second = engine.new_worker(concurrency=4, lease_seconds=30, max_claims=3, on_compensation_failed=ALERTS.append)
    await asyncio.gather(engine.run_until_idle(), second.run_until_idle())
    await engine.run_until_idle()

    assert [(await engine.client.get(i)).status for i in ids] == ["COMPENSATION_FAILED"] * 6
    assert sorted(a["instance_id"] for a in ALERTS) == sorted(ids)
    per_instance = await conn.fetch("SELECT instance_id, count(*) AS n FROM stepstone.outbox "
                                  "WHERE type = 'stepstone.compensation_failed' GROUP BY instance_id")
    assert sorted(str(r["instance_id"]) for r in per_instance) == sorted(ids)
    assert {r["n"] for r in per_instance} == {1}
    # Every instance: two compensated once, one attempted exactly its policy's three times.
    for iid in ids:
        calls = [c for i, c in w.CALLS if i == iid]
        assert calls == ["two", "one", "one", "one"]


async def test_branches_compensate_in_reverse_order_of_completion(engine: Engine) -> None:
    iid = await engine.client.start(w.forked, {})
    w.HOLD[iid] = asyncio.Event()  # step_a waits in its handler
    run = asyncio.create_task(engine.run_until_idle())
    await engine.worker.events.wait_until(lambda: engine.worker.events.commits >= 2)  # first, then step_b
    w.HOLD[iid].set()
    await run

    info = await engine.client.get(iid)
    assert info.status == "COMPENSATED"
    completed = [(r["position"], r["step"]) for r in await engine.client.compensations(iid)]
    assert completed == [("", "first"), ("split/b", "step_b"), ("split/a", "step_a")]
    assert [c for _, c in w.CALLS] == ["step_a", "step_b", "first"]


async def test_two_workers_racing_for_one_exhausted_compensation_alert_once(
    engine: Engine, conn: asyncpg.Connection
) -> None:
    w.RACE.update(entered=asyncio.Event(), release=asyncio.Event())
    iid = await engine.client.start(w.touchy, {})
    await engine.run_until_idle()
    await engine.client.cancellation(iid, "called off", compensate=True)
    [claim] = await engine.store.claim(1, 30, "first-worker")
    assert claim.command.kind == "COMPENSATE"
    first = engine.new_worker(concurrency=1, lease_seconds=30, max_claims=3, on_compensation_failed=ALERTS.append)
    try:
        racing = asyncio.create_task(first._segment(claim))
        await w.RACE["entered"].wait()  # the first worker runs the compensation, holding the lease
        await engine.move_clock(31)  # its lease expires while the handler runs
        await engine.run_until_idle()  # the second worker re-claims, runs it too, and gives it up
        assert (await engine.client.get(iid)).status == "COMPENSATION_FAILED"
        assert [a["instance_id"] for a in ALERTS] == [iid]
    finally:
        w.RACE["release"].set()
    await racing  # the first worker's handler fails too; its exhausted commit is refused: no second alert

    assert first.events.fenced == 1
    assert [c for _, c in w.CALLS] == ["book", "book"]
    assert [a["instance_id"] for a in ALERTS] == [iid]
    assert await conn.fetchval("SELECT count(*) FROM stepstone.outbox WHERE type = 'stepstone.compensation_failed' "
                               "AND instance_id = $1", iid) == 1
    assert kinds(await engine.client.history(iid)).count("COMPENSATION_FAILED") == 1


async def test_retry_resumes_at_the_compensation_given_up_then_goes_on(engine: Engine) -> None:
    iid = await engine.client.start(w.linear, {})
    w.FAIL[(iid, "three")] = -1
    w.FAIL[(iid, "undo_two")] = -1  # the first compensation gives up; one is still to undo
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPENSATION_FAILED"
    assert [(r["step"], r["status"]) for r in await engine.client.compensations(iid)] == [
        ("one", "PENDING"), ("two", "FAILED")]
    assert [c for _, c in w.CALLS] == ["two", "two"]  # its policy: two attempts; one never started

    w.FAIL.pop((iid, "undo_two"))
    await engine.client.retry(iid)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPENSATED"
    assert info.state["undone"] == ["two:two-1", "one:{'id': 'one-1'}"]
    assert [c for _, c in w.CALLS] == ["two", "two", "two", "one"]
    history = await engine.client.history(iid)
    assert [h["step"] for h in history if h["kind"] == "STEP_COMPENSATED"] == ["two", "one"]


async def test_a_bulk_retry_resumes_a_compensation_as_a_single_retry_does(engine: Engine) -> None:
    """`stepstone repair retry`, the API's `POST /bulk/retry` and the UI's incidents page retry in bulk
    (Operations.retry): that went straight to the plain retry, which refused a COMPENSATION_FAILED
    instance ('not_failed: it is COMPENSATION_FAILED; only a FAILED instance can be retried') that
    `client.retry` resumes."""
    from stepstone.ops import InstanceFilter, Operations  # noqa: PLC0415 - only this test reads the operator's tools

    iid = await engine.client.start(w.linear, {})
    w.FAIL[(iid, "three")] = -1
    w.FAIL[(iid, "undo_one")] = -1
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPENSATION_FAILED"
    w.FAIL.pop((iid, "undo_one"))
    ops = Operations.on(engine.store, actor="oncall")
    planned = await ops.retry(where=InstanceFilter(status=("COMPENSATION_FAILED",)), dry_run=True)
    assert planned.matched == 1
    report = await ops.retry([iid])
    assert (report.succeeded, report.items[0].outcome) == (1, "retried"), report
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPENSATED"


async def test_a_bulk_cancel_leaves_an_ended_saga_as_a_single_cancel_does(engine: Engine) -> None:
    """`stepstone repair cancel`, the API's `POST /bulk/cancel` (Operations.cancel) counted a COMPENSATED
    instance as cancelled (outcome 'cancelled', status COMPENSATED: nothing had changed), where
    `client.cancel` says 'unchanged': the bulk statement knew only COMPLETED and CANCELLED as ended."""
    from stepstone.ops import Operations  # noqa: PLC0415 - only this test reads the operator's tools

    iid = await engine.client.start(w.linear, {})
    w.FAIL[(iid, "three")] = -1
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPENSATED"
    assert (await engine.client.cancellation(iid)).outcome == "unchanged"
    report = await Operations.on(engine.store, actor="oncall").cancel([iid])
    item = report.items[0]
    assert (report.succeeded, item.outcome, item.status) == (0, "unchanged", "COMPENSATED"), report
    assert "INSTANCE_CANCELLED" not in kinds(await engine.client.history(iid))


async def test_a_bulk_cancel_can_compensate_as_a_single_cancel_does(engine: Engine) -> None:
    """`client.cancel(compensate=True)` and `stepstone cancel --compensate` undo a saga's completed steps
    first; `stepstone repair cancel`, the API's `POST /bulk/cancel` and Operations.cancel could only cancel
    without compensating, leaving every booking of a batch of cancelled sagas in place."""
    from stepstone.ops import InstanceFilter, Operations  # noqa: PLC0415 - only this test reads the operator's tools

    ids = [await engine.client.start(w.waiting, {"trip": f"t{n}"}) for n in range(2)]
    await engine.run_until_idle()
    ops = Operations.on(engine.store, actor="oncall")
    report = await ops.cancel(where=InstanceFilter(workflow="waiting"), reason="promotion withdrawn", compensate=True)
    assert (report.succeeded, report.failed) == (2, 0), report
    assert {i.outcome for i in report.items} == {"compensating"}
    await engine.run_until_idle()
    for iid in ids:
        info = await engine.client.get(iid)
        assert (info.status, info.state["undone"]) == ("CANCELLED", ["book:None"])
        asked = [h["data"] for h in await engine.client.history(iid) if h["kind"] == "CANCEL_REQUESTED"]
        assert asked == [{"reason": "promotion withdrawn", "compensate": True, "status_before": "WAITING"}]


async def test_a_compensation_given_up_is_still_owed_when_a_replayed_saga_compensates_again(engine: Engine) -> None:
    """A COMPENSATION_FAILED saga replayed (from `two`, the step compensated last: a replay from its failed
    step is refused, `two` having been undone since) that fails again compensates once more: the step
    whose compensation was given up is still not undone, so it is compensated too. Its record stayed
    FAILED and the new round passed over it, ending the instance COMPENSATED with `one` never undone and
    no alert."""
    iid = await engine.client.start(w.linear, {})
    w.FAIL[(iid, "three")] = -1
    w.FAIL[(iid, "undo_one")] = -1
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPENSATION_FAILED"
    assert [(r["step"], r["status"]) for r in await engine.client.compensations(iid)] == [
        ("one", "FAILED"), ("two", "COMPENSATED")]

    w.FAIL.pop((iid, "undo_one"))  # the service is back; `three` still fails
    await engine.client.replay(iid, "two")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPENSATED"
    # The replay's state is the one `two` had; then two's new run and one are undone.
    assert info.state["undone"] == ["two:two-1", "one:{'id': 'one-1'}"]
    assert [(r["step"], r["status"]) for r in await engine.client.compensations(iid)] == [
        ("one", "COMPENSATED"), ("two", "COMPENSATED"), ("two", "COMPENSATED")]
    # two, three given-up attempts of one; after the replay two's new run, then one at last
    assert [c for _, c in w.CALLS] == ["two", "one", "one", "one", "two", "one"]


async def test_a_replayed_saga_that_cannot_compensate_the_step_given_up_stops_again(engine: Engine) -> None:
    iid = await engine.client.start(w.linear, {})
    w.FAIL[(iid, "three")] = -1
    w.FAIL[(iid, "undo_one")] = -1
    await engine.run_until_idle()
    ALERTS.clear()
    await engine.client.replay(iid, "two")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPENSATION_FAILED"
    assert [a["step"] for a in ALERTS] == ["one"]


class _Card(BaseModel):
    card: str = "4111"

    @model_validator(mode="after")
    def _known(self) -> _Card:
        if self.card == "unknown":
            raise KeyError("no such card")  # not a ValueError: pydantic lets it through as it is
        return self


_carded: Workflow[_Card] = Workflow("carded", state=_Card)


@_carded.step(start=True, next="pay")
def _hold(ctx: StepContext, state: _Card) -> None:
    ctx.record("hold-1")


@_carded.compensation("_hold", retry=Retry(max_attempts=3, backoff=0))
def _release(ctx: CompensationContext, state: _Card, recorded: Any) -> None:
    state.card = "unknown"


@_carded.step(next=None, name="pay", retry=Retry(max_attempts=1))
def _pay(ctx: StepContext, state: _Card) -> None:
    raise w.Declined("no")


async def test_a_compensation_whose_state_the_model_refuses_fails_instead_of_crashing_its_worker(
    database_url: str,
) -> None:
    """A state model's validator that raises something other than a ValueError, on the state a
    compensation left, crashed the worker's segment: the compensation was claimed again after each lease
    expiry until it was dead-lettered. A step's handler leaving the same state fails the step at once
    (InvalidState, never retried): a compensation now does the same, so the saga stops at
    COMPENSATION_FAILED after one attempt, with the reason."""
    async with open_engine(database_url, Registry(_carded)) as engine:
        iid = await engine.client.start(_carded, {})
        await engine.run_until_idle()
        info = await engine.client.get(iid)
        assert info.status == "COMPENSATION_FAILED"
        assert info.error["attempts"] == 1
        assert info.error["error"]["type"] == "InvalidState"
        assert "state left by the compensation of '_hold' cannot be stored: KeyError" in info.error["error"]["message"]


async def test_a_saga_stopped_at_compensation_failed_says_which_step_and_why_in_its_error(engine: Engine) -> None:
    """`stepstone show` printed `error  CompensationFailed:` and nothing else: the instance's error held
    only the compensation record's id and, nested, the last error, while every reader (the CLI, the UI's
    error box, the API) looks for a message and a step, as a failed step's error has."""
    from stepstone.cli.instances import describe_error  # noqa: PLC0415 - what `stepstone show` prints

    iid = await engine.client.start(w.linear, {})
    w.FAIL[(iid, "three")] = -1
    w.FAIL[(iid, "undo_one")] = -1
    await engine.run_until_idle()
    error = (await engine.client.get(iid)).error
    assert error is not None
    assert (error["type"], error["step"], error["attempts"]) == ("CompensationFailed", "one", 3)
    assert without_frames(error)["error"] == {"type": "Boom", "message": "undo_one is down"}
    assert describe_error(error) == (
        "CompensationFailed: the compensation of step 'one' gave up after 3 attempts: Boom: undo_one is down "
        "(step one)")



async def test_a_compensated_saga_replayed_runs_again(engine: Engine) -> None:
    """`stepstone replay` of a saga that had ended COMPENSATED (or TIMED_OUT, or CANCELLED after
    compensating) answered "replayed", status RUNNING, and wrote INSTANCE_REPLAYED, but the instance
    stayed COMPENSATED and the step it was to run again was rejected (INSTANCE_ENDED): once a saga had
    begun, only the saga could change the instance's status, and a replay did not end the saga."""
    iid = await engine.client.start(w.linear, {})
    w.FAIL[(iid, "three")] = 1  # fails once: the replay's run completes
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPENSATED"
    replayed = await engine.client.replay(iid, "one")
    assert (replayed.status, (await engine.client.get(iid)).status) == ("RUNNING", "RUNNING")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.state["log"]) == ("COMPLETED", ["one", "two", "three"])


async def test_the_entry_that_ends_a_saga_lists_what_its_own_round_compensated(engine: Engine) -> None:
    """A saga replayed after it had compensated, then compensated again, ended with INSTANCE_COMPENSATED
    listing every compensation the instance ever made: ["two", "one", "two", "one"] the second time."""
    iid = await engine.client.start(w.linear, {})
    w.FAIL[(iid, "three")] = -1
    await engine.run_until_idle()
    await engine.client.replay(iid, "one")
    await engine.run_until_idle()
    ends = [h["data"] for h in await engine.client.history(iid) if h["kind"] == "INSTANCE_COMPENSATED"]
    assert ends == [{"cause": "failed", "compensated": ["two", "one"]}] * 2
    assert [(r["step"], r["status"]) for r in await engine.client.compensations(iid)] == [
        ("one", "COMPENSATED"), ("two", "COMPENSATED"), ("one", "COMPENSATED"), ("two", "COMPENSATED")]


async def test_a_failed_step_logs_a_warning_that_compensation_starts_and_an_error_only_when_it_gives_up(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    # The saga's failing step was logged at ERROR "failed at step" while the instance compensated.
    caplog.set_level(logging.WARNING, logger="stepstone.worker")
    compensated = await engine.client.start(w.linear, {})
    w.FAIL[(compensated, "three")] = -1
    gave_up = await engine.client.start(w.linear, {})
    w.FAIL[(gave_up, "three")] = -1
    w.FAIL[(gave_up, "undo_one")] = -1
    await engine.run_until_idle()
    assert (await engine.client.get(compensated)).status == "COMPENSATED"
    assert (await engine.client.get(gave_up)).status == "COMPENSATION_FAILED"

    def lines(iid: str) -> list[tuple[int, str]]:
        return [(r.levelno, r.getMessage()) for r in caplog.records if iid in r.getMessage()]

    [(level, message)] = lines(compensated)
    assert level == logging.WARNING
    assert message.startswith(f"step three of linear instance {compensated} failed, compensation starts: Boom")
    assert len([m for _, m in lines(gave_up) if "compensation starts" in m]) == 1
    errors = [m.split(" gave up")[0] for level, m in lines(gave_up) if level >= logging.ERROR]
    assert errors == [f"compensation of step one of linear instance {gave_up} position '$saga'"]


async def test_a_replay_from_after_a_compensated_step_is_refused(engine: Engine) -> None:
    """A replay from a step that a compensated step ran before completed with that step undone: `three`
    replayed after `two` and `one` were compensated ran `three` alone and ended COMPLETED, the trip half
    undone. It is refused, naming the step to replay from; a replay from there runs it again."""
    iid = await engine.client.start(w.linear, {})
    w.FAIL[(iid, "three")] = 1  # fails once: the saga compensates two, then one
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPENSATED"
    for step in ("three", "two"):
        with pytest.raises(InvalidState, match=r"step 'one' ran before .* and was compensated .* replay from 'one'"):
            await engine.client.replay(iid, step)
    assert (await engine.client.get(iid)).status == "COMPENSATED"  # nothing was written
    assert "INSTANCE_REPLAYED" not in kinds(await engine.client.history(iid))

    await engine.client.replay(iid, "one")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.state["log"]) == ("COMPLETED", ["one", "two", "three"])
    # Once run again, neither is compensated any more: a replay from the last step is taken.
    assert (await engine.client.replay(iid, "three")).status == "RUNNING"
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"
