"""Runtime hardening: what a handler leaves, raises or emits can never commit a bad state,
crash a segment or take the worker down.

Every test here failed before its fix (issue 9, items 1, 2 and 15).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from stepstone.authoring.workflow import StepContext
from stepstone.errors import InvalidInput
from stepstone.testing import Engine
from tests.engine.conftest import Rows, kinds
from tests.engine.hardening import workflows as hw


async def _failed_once(engine: Engine, rows: Rows, iid: str, step: str) -> dict[str, Any]:
    """The instance FAILED after exactly one run of `step`, with no crash and nothing left open."""
    info = await engine.client.get(iid)
    assert info.status == "FAILED", info
    assert hw.RUNS[iid, step] == 1
    assert engine.worker.events.crashed == 0 and engine.worker.events.claims == 1
    assert await rows.open_commands(iid) == []
    history = kinds(await engine.client.history(iid))
    assert history.count("STEP_FAILED") == 1 and history[-1] == "INSTANCE_FAILED"
    assert info.error is not None
    return info.error


# -- item 1: the state a step leaves is validated against the model --------------------------------------


async def test_last_step_cannot_complete_with_a_state_the_model_forbids(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(hw.strict_last, {"qty": 3})
    await engine.run_until_idle()
    error = await _failed_once(engine, rows, iid, "spoil_last")
    assert error["type"] == "InvalidState"
    assert "qty" in error["message"] and "greater than 0" in error["message"]
    assert (await engine.client.get(iid)).state == {"qty": 3, "log": []}  # as before the step


async def test_bad_state_is_never_committed_for_the_next_step(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(hw.strict_mid, {"qty": 1})
    await engine.run_until_idle()
    error = await _failed_once(engine, rows, iid, "spoil_first")
    assert error["type"] == "InvalidState" and error["step"] == "spoil_first" and "qty" in error["message"]
    info = await engine.client.get(iid)
    assert info.step == "spoil_first" and info.state == {"qty": 1, "log": []}
    assert hw.RUNS[iid, "after_spoil"] == 0


async def test_a_value_of_the_wrong_type_is_named_as_the_models_error(engine: Engine, rows: Rows) -> None:
    """A step that put a text where the model holds a number failed with "cannot be stored: UserWarning:
    Pydantic serializer warnings:" where warnings are errors (pytest's `filterwarnings = error`, as this
    suite and the testing kit's users run), and printed that warning in a worker elsewhere: the state was
    serialized with pydantic's warnings on before being validated. Now the validation names the field."""
    iid = await engine.client.start(hw.strict_typed, {"qty": 3})
    await engine.run_until_idle()
    error = await _failed_once(engine, rows, iid, "mistype")
    assert error["type"] == "InvalidState"
    assert "is invalid: qty: Input should be a valid integer" in error["message"], error


async def test_a_mutated_model_instance_is_validated_at_start(engine: Engine, rows: Rows) -> None:
    value = hw.Strict(qty=2)
    value.qty = -1  # no validation on assignment: the model instance itself is invalid now
    with pytest.raises(InvalidInput, match="qty"):
        await engine.client.start(hw.strict_last, value)
    assert await rows.count("SELECT count(*) FROM stepstone.instances") == 0
    fine = await engine.client.start(hw.strict_last, hw.Strict(qty=2))
    assert (await engine.client.get(fine)).state == {"qty": 2, "log": []}


# -- item 2: a handler's BaseException is a step failure, and the worker keeps running ----------------


BASE_EXCEPTIONS = [
    pytest.param(lambda: SystemExit(3), id="SystemExit"),
    pytest.param(KeyboardInterrupt, id="KeyboardInterrupt"),
    pytest.param(GeneratorExit, id="GeneratorExit"),
    pytest.param(asyncio.CancelledError, id="CancelledError-not-the-workers"),
]


@pytest.mark.parametrize("make", BASE_EXCEPTIONS)
@pytest.mark.parametrize("workflow", [hw.bang_sync, hw.bang_async], ids=["sync", "async"])
async def test_base_exception_in_a_handler_is_a_retried_step_failure(
    engine: Engine, rows: Rows, workflow: Any, make: Any
) -> None:
    iid = await engine.client.start(workflow, {})
    exc = make()
    hw.RAISE[iid] = exc
    await engine.run_until_idle()
    assert engine.worker.events.crashed == 0
    [failed] = [h for h in await engine.client.history(iid) if h["kind"] == "STEP_FAILED"]
    assert failed["data"]["type"] == type(exc).__name__ and failed["data"]["retry_in"] == 1.0
    [cmd] = await rows.open_commands(iid)
    assert cmd["state"] == "PENDING" and cmd["attempt"] == 2

    await engine.move_clock(1.5)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["log"] == ["ok@2"]
    assert hw.RUNS[iid, workflow.plan.start] == 2


async def test_a_running_worker_survives_system_exit_and_keyboard_interrupt(engine: Engine) -> None:
    first = await engine.client.start(hw.bang_sync, {})
    hw.RAISE[first] = SystemExit(1)
    second = await engine.client.start(hw.bang_async, {})
    hw.RAISE[second] = KeyboardInterrupt()
    worker = engine.new_worker(concurrency=2, lease_seconds=30, poll_interval=0.05, worker_id="survivor")
    await worker.start()
    try:
        await worker.events.wait_until(lambda: worker.events.commits >= 2, timeout=10)  # both failed once
        third = await engine.client.start(hw.bang_sync, {})
        # Both retries (after their 1 s backoff on the database clock) and the third instance.
        await worker.events.wait_until(lambda: worker.events.commits >= 5, timeout=10)
        assert all(not loop.done() for loop in worker._loops)  # the worker is alive
        assert [(await engine.client.get(i)).status for i in (first, second, third)] == ["COMPLETED"] * 3
        for iid, raised in ((first, "SystemExit"), (second, "KeyboardInterrupt")):
            history = await engine.client.history(iid)
            assert [h["data"]["type"] for h in history if h["kind"] == "STEP_FAILED"] == [raised]
        assert worker.events.crashed == 0
    finally:
        await worker.stop(drain_timeout=1)


async def test_dead_letter_of_a_crashing_command_names_the_last_error(
    engine: Engine, rows: Rows, monkeypatch: pytest.MonkeyPatch
) -> None:
    iid = await engine.client.start(hw.bang_sync, {})
    real_commit = engine.store.commit

    async def exploding_commit(request: Any, **kw: Any) -> Any:
        if request.claim.instance.id == iid and request.decision.settle.state != "DEAD":
            raise RuntimeError("commit exploded\x00 here")
        return await real_commit(request, **kw)

    monkeypatch.setattr(engine.store, "commit", exploding_commit)
    max_claims = engine.worker.config.max_claims
    for n in range(1, max_claims + 2):  # its first crash, then max_claims alone
        await engine.run_until_idle()
        assert engine.worker.events.crashed == n
        await engine.move_clock(31)  # the crashed segment's lease runs out
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED" and info.error["type"] == "DeadLetter"
    assert "last error: segment crashed: RuntimeError: commit exploded\\x00 here" in info.error["message"]
    [cmd] = await rows.commands(iid)
    assert cmd["state"] == "DEAD" and "commit exploded" in cmd["last_error"]


# -- item 15: events and error text are checked before the commit ----------------------------------------


def _emit(ctx: StepContext, n: int = 1, *, type_: Any = "ok", key: Any = None, size: int = 10) -> None:
    for _ in range(n):
        ctx.emit(type_, hw.payload_of(size), key=key)


BAD_EMITS = [
    pytest.param(lambda ctx: _emit(ctx, type_="a\x00b"), "NUL", id="type-with-NUL"),
    pytest.param(lambda ctx: _emit(ctx, type_="a\ud800b"), "surrogate", id="type-with-lone-surrogate"),
    pytest.param(lambda ctx: _emit(ctx, type_="t" * 201), "200", id="type-too-long"),
    pytest.param(lambda ctx: _emit(ctx, type_=""), "non-empty", id="type-empty"),
    pytest.param(lambda ctx: _emit(ctx, type_=42), "non-empty string", id="type-not-a-string"),
    pytest.param(lambda ctx: _emit(ctx, key="k\x00"), "NUL", id="key-with-NUL"),
    pytest.param(lambda ctx: _emit(ctx, key="k\udfff"), "surrogate", id="key-with-lone-surrogate"),
    pytest.param(lambda ctx: _emit(ctx, key="k" * 201), "200", id="key-too-long"),
    pytest.param(lambda ctx: _emit(ctx, 101), "100 per step", id="too-many-events"),
    pytest.param(lambda ctx: _emit(ctx, 5, size=250_000), "bytes per step", id="commit-too-large"),
]


@pytest.mark.parametrize(("action", "says"), BAD_EMITS)
async def test_a_bad_event_fails_the_step_once_cleanly(engine: Engine, rows: Rows, action: Any, says: str) -> None:
    iid = await engine.client.start(hw.emitter, {})
    hw.EMIT[iid] = action
    await engine.run_until_idle()
    error = await _failed_once(engine, rows, iid, "emit")
    assert error["type"] == "PayloadRejected" and says in error["message"], error
    assert await rows.count("SELECT count(*) FROM stepstone.outbox") == 0
    assert (await engine.client.get(iid)).state == {"log": []}


async def test_events_within_the_limits_commit(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(hw.emitter, {})
    hw.EMIT[iid] = lambda ctx: _emit(ctx, 100, type_="t" * 200, key="k" * 200, size=5_000)
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"
    assert await rows.count("SELECT count(*) FROM stepstone.outbox") == 100


async def test_a_returned_step_name_with_nul_or_of_any_length_fails_cleanly(engine: Engine, rows: Rows) -> None:
    for returned in ("next\x00step\ud800", "s" * 1_000_000):
        iid = await engine.client.start(hw.chooser, {})
        hw.CHOOSE[iid] = returned
        await engine.run_until_idle()
        info = await engine.client.get(iid)
        assert info.status == "FAILED" and info.error["type"] == "InvalidTransition"
        assert len(info.error["message"]) < 300
    assert engine.worker.events.crashed == 0


async def test_error_text_with_nul_and_lone_surrogate_is_stored_escaped(engine: Engine, rows: Rows) -> None:
    def raise_bad_text(ctx: StepContext) -> None:
        raise hw.BadText("bad\x00text \ud800 end")

    iid = await engine.client.start(hw.emitter, {})
    hw.EMIT[iid] = raise_bad_text
    await engine.run_until_idle()
    error = await _failed_once(engine, rows, iid, "emit")
    assert error["type"] == "BadText" and error["message"] == "bad\\x00text \\ud800 end"


async def test_group_commit_of_a_clean_failure_does_not_sink_the_batch(engine: Engine) -> None:
    """Several segments failing on bad events at once go through the group commit like any other."""
    ids = [await engine.client.start(hw.emitter, {}) for _ in range(4)]
    for iid in ids[:2]:
        hw.EMIT[iid] = lambda ctx: _emit(ctx, type_="a\x00b")
    await engine.run_until_idle()
    statuses = [(await engine.client.get(iid)).status for iid in ids]
    assert statuses == ["FAILED", "FAILED", "COMPLETED", "COMPLETED"]
    assert engine.worker.events.crashed == 0
