"""The durable loop end to end: steps, timers, signals, dedup, start idempotency, input checks."""

from __future__ import annotations

import uuid
from collections import Counter

import pytest

from stepstone.errors import (
    BusinessKeyInUse,
    DefinitionNotFound,
    IdempotencyConflict,
    InstanceNotFound,
    InvalidInput,
    InvalidState,
    PayloadTooDeep,
    PayloadTooLarge,
    UnknownSignal,
)
from stepstone.testing import Engine
from tests.engine.conftest import Rows, kinds
from tests.engine.workflows import signals, three, timed, waiter


async def test_three_steps_complete_with_one_commit_per_step(engine: Engine) -> None:
    iid = await engine.client.start(three, {"order_id": "o-1"})
    await engine.run_until_idle()

    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.step is None and info.ended_at is not None
    assert info.state["log"] == ["a", "b", "c"]
    history = await engine.client.history(iid)
    assert [h["seq"] for h in history] == list(range(1, len(history) + 1))
    assert kinds(history) == [
        "INSTANCE_STARTED", "STEP_COMPLETED", "STEP_COMPLETED", "STEP_COMPLETED", "INSTANCE_COMPLETED",
    ]
    done = Counter(h["step"] for h in history if h["kind"] == "STEP_COMPLETED")
    assert done == {"a": 1, "b": 1, "c": 1}
    # Each visit's patch records exactly what that step changed.
    patches = [h["data"]["patch"] for h in history if h["kind"] == "STEP_COMPLETED"]
    assert patches[0] == [{"op": "replace", "path": "/log", "value": ["a"]}]
    assert engine.worker.events.commits == 3


async def test_timer_fires_only_after_the_database_clock_passes_it(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(timed, {"order_id": "o-2"})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "WAITING" and info.step == "nap"
    assert info.next_timer_at is not None
    due = info.next_timer_at

    await engine.move_clock(299)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "WAITING" and info.step == "nap"
    assert await engine.store.db_now() < due

    await engine.move_clock(2)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED"
    assert info.state["log"] == ["before", "after"]
    assert "TIMER_FIRED" in kinds(await engine.client.history(iid))
    assert await rows.open_commands(iid) == []


async def test_early_signal_is_parked_then_applied_at_the_wait(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(signals, {"order_id": "o-3"})
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).step == "nap"

    go = await engine.client.signal(iid, "go", {"n": 1})
    later = await engine.client.signal(iid, "later")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "WAITING" and info.step == "nap" and info.parked_signals == 2
    states = {c["id"]: c["state"] for c in await rows.commands(iid)}
    assert states[go] == "PARKED" and states[later] == "PARKED"
    assert kinds(await engine.client.history(iid)).count("SIGNAL_PARKED") == 2

    await engine.move_clock(61)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info
    assert info.state["log"] == ["mid:go:{'n': 1}", "finish:later"]
    applied = [h for h in await engine.client.history(iid) if h["kind"] == "SIGNAL_APPLIED"]
    assert [(h["step"], h["data"]["signal"], h["data"]["command"]) for h in applied] == [
        ("first_wait", "go", go), ("second_wait", "later", later),
    ]
    states = {c["id"]: c["state"] for c in await rows.commands(iid)}
    assert states[go] == "COMPLETE" and states[later] == "COMPLETE"


async def test_signal_the_wait_does_not_accept_stays_parked(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(signals, {"order_id": "o-4"})
    await engine.run_until_idle()
    later = await engine.client.signal(iid, "later")
    await engine.move_clock(61)
    await engine.run_until_idle()

    info = await engine.client.get(iid)
    assert info.status == "WAITING" and info.step == "first_wait" and info.parked_signals == 1
    assert [c["state"] for c in await rows.commands(iid) if c["id"] == later] == ["PARKED"]
    # Parked, it blocks nothing: the accepted signal still gets through, and then `later` applies.
    await engine.client.signal(iid, "go")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.parked_signals == 0
    assert info.state["log"] == ["mid:go:None", "finish:later"]


async def test_signals_to_ended_or_undeclared_are_refused(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(waiter, {"order_id": "o-5"})
    await engine.run_until_idle()
    before = await rows.dump()
    with pytest.raises(UnknownSignal) as err:
        await engine.client.signal(iid, "nope", {"x": 1}, dedup_key="k")
    assert err.value.name == "nope" and err.value.instance_id == iid
    assert await rows.dump() == before

    await engine.client.signal(iid, "go")
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"
    before = await rows.dump()
    with pytest.raises(InvalidState) as ended:
        await engine.client.signal(iid, "go")
    assert ended.value.status == "COMPLETED" and ended.value.instance_id == iid
    assert await rows.dump() == before


async def test_repeated_dedup_key_applies_once(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(waiter, {"order_id": "o-6"})
    first = await engine.client.signal(iid, "go", {"amount": 3}, dedup_key="pay-1")
    again = await engine.client.signal(iid, "go", {"amount": 3}, dedup_key="pay-1")
    assert again == first
    await engine.run_until_idle()
    assert await engine.client.signal(iid, "go", {"amount": 3}, dedup_key="pay-1") == first

    with pytest.raises(IdempotencyConflict) as err:
        await engine.client.signal(iid, "go", {"amount": 4}, dedup_key="pay-1")
    assert err.value.instance_id == iid and err.value.command_id == first

    history = await engine.client.history(iid)
    assert kinds(history).count("SIGNAL_APPLIED") == 1
    assert len([c for c in await rows.commands(iid) if c["kind"] == "SIGNAL"]) == 1
    assert (await engine.client.get(iid)).status == "COMPLETED"


async def test_start_idempotency_and_business_keys(engine: Engine, rows: Rows) -> None:
    first = await engine.client.start(three, {"order_id": "o-7"}, idempotency_key="start-1")
    again = await engine.client.start(three, {"order_id": "o-7"}, idempotency_key="start-1")
    assert again == first
    assert await rows.count("SELECT count(*) FROM stepstone.instances") == 1

    with pytest.raises(IdempotencyConflict) as err:
        await engine.client.start(three, {"order_id": "other"}, idempotency_key="start-1")
    assert err.value.instance_id == first and first in str(err.value)
    assert await rows.count("SELECT count(*) FROM stepstone.instances") == 1

    holder = await engine.client.start(three, {"order_id": "o-8"}, business_key="order-8")
    before = await rows.dump()
    with pytest.raises(BusinessKeyInUse) as used:
        await engine.client.start(three, {"order_id": "o-8b"}, business_key="order-8")
    assert used.value.instance_id == holder and used.value.business_key == "order-8"
    assert await rows.dump() == before
    # A business key is per definition: another workflow may use the same one.
    await engine.client.start(timed, {"order_id": "o-8"}, business_key="order-8")


async def test_input_is_checked_before_anything_is_stored(engine: Engine, rows: Rows) -> None:
    with pytest.raises(InvalidInput, match="order_id"):
        await engine.client.start(three, {"log": []})
    with pytest.raises(PayloadTooLarge):
        await engine.client.start(three, {"order_id": "x" * (300 * 1024)})
    deep: dict[str, object] = {}
    node = deep
    for _ in range(40):
        node["d"] = {}
        node = node["d"]  # type: ignore[assignment]
    with pytest.raises(PayloadTooDeep):
        await engine.client.start(three, {"order_id": "o-9", "data": deep})
    with pytest.raises(DefinitionNotFound):
        await engine.client.start("no-such-workflow", {})
    assert await rows.count("SELECT count(*) FROM stepstone.instances") == 0
    assert await rows.count("SELECT count(*) FROM stepstone.commands") == 0

    iid = await engine.client.start(waiter, {"order_id": "o-9"})
    before = await rows.dump()
    with pytest.raises(PayloadTooLarge):
        await engine.client.signal(iid, "go", {"blob": "y" * (300 * 1024)})
    with pytest.raises(PayloadTooDeep):
        await engine.client.signal(iid, "go", deep)
    assert await rows.dump() == before

    for missing in (str(uuid.uuid4()), "not-a-uuid", ""):
        with pytest.raises(InstanceNotFound):
            await engine.client.get(missing)
        with pytest.raises(InstanceNotFound):
            await engine.client.signal(missing, "go")
        with pytest.raises(InstanceNotFound):
            await engine.client.cancel(missing)
        with pytest.raises(InstanceNotFound):
            await engine.client.retry(missing)
        with pytest.raises(InstanceNotFound):
            await engine.client.history(missing)
    assert await rows.dump() == before
