"""Batch starts (`Client.start_many`, migration 0023): one statement per batch writes what as many single
starts write, keeps their rules (pin admission, idempotency and business keys, redaction, flow limits,
deadlines, a wake-up for idle workers), and is all or nothing."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import asyncpg
import pytest

from stepstone.core.pin import pin_of
from stepstone.errors import BusinessKeyInUse, DefinitionDrift, IdempotencyConflict, InvalidInput, PayloadTooLarge
from stepstone.store.port import NewInstances
from stepstone.testing import Engine, open_engine
from tests.engine.conftest import Rows
from tests.engine.workflows import three

_NOT_COMPARED = {"id", "instance_id", "created_at", "updated_at", "at", "available_at", "seq", "target"}


def _shape(rows: list[asyncpg.Record]) -> list[dict[str, Any]]:
    """Rows without what differs between any two starts (ids, times, sequence numbers)."""
    return [{k: v for k, v in dict(r).items() if k not in _NOT_COMPARED} for r in rows]


async def _rows_of(conn: asyncpg.Connection, instance_id: str) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for table, key in (("instances", "id"), ("positions", "instance_id"), ("commands", "instance_id"),
                       ("history", "instance_id")):
        out[table] = _shape(await conn.fetch(f"SELECT * FROM stepstone.{table} WHERE {key} = $1::uuid ORDER BY 1",
                                             instance_id))
    return out


async def test_a_batch_writes_what_single_starts_write_and_runs(engine: Engine, rows: Rows) -> None:
    single = await engine.client.start(three, {"order_id": "o-1"})
    batch = await engine.client.start_many(three, [{"order_id": "o-1"}, {"order_id": "o-2"}, {"order_id": "o-3"}])
    assert len(set(batch)) == 3 and single not in batch
    assert await _rows_of(rows.conn, batch[0]) == await _rows_of(rows.conn, single)
    await engine.run_until_idle()
    for iid, order in zip(batch, ("o-1", "o-2", "o-3"), strict=True):
        info = await engine.client.get(iid)
        assert info.status == "COMPLETED" and info.state["order_id"] == order  # ids come back in input order
    assert await engine.client.start_many(three, []) == []


async def test_batches_of_a_long_input_keep_the_order_and_report_progress(engine: Engine, rows: Rows) -> None:
    seen: list[tuple[int, int]] = []
    ids = await engine.client.start_many(three, [{"order_id": f"o-{n}"} for n in range(25)], batch_size=10,
                                         on_batch=lambda done, total: seen.append((done, total)))
    dones = [d for d, _ in seen]  # a call per batch (3); two are in flight, so either may end first
    assert len(seen) == 3 and dones == sorted(set(dones)) and seen[-1] == (25, 25)
    orders = {str(r["id"]): r["order_id"] for r in await rows.conn.fetch(
        "SELECT id, state ->> 'order_id' AS order_id FROM stepstone.instances")}
    assert [orders[i] for i in ids] == [f"o-{n}" for n in range(25)]


async def test_idempotency_keys_in_a_batch(engine: Engine, rows: Rows) -> None:
    first = await engine.client.start(three, {"order_id": "o-1"}, idempotency_key="k-1")
    ids = await engine.client.start_many(three, [{"order_id": "o-1"}, {"order_id": "o-2"}, {"order_id": "o-2"}],
                                         idempotency_keys=["k-1", "k-2", "k-2"])
    assert ids[0] == first and ids[1] == ids[2] != first  # an earlier call's key, and a key repeated in the batch
    assert await rows.count("SELECT count(*) FROM stepstone.instances") == 2
    assert await engine.client.start_many(three, [{"order_id": "o-1"}, {"order_id": "o-2"}],
                                          idempotency_keys=["k-1", "k-2"]) == ids[:2]

    before = await rows.dump()
    with pytest.raises(IdempotencyConflict) as err:  # other input under a used key: the batch starts nothing
        await engine.client.start_many(three, [{"order_id": "o-9"}, {"order_id": "other"}],
                                       idempotency_keys=["k-9", "k-2"])
    assert err.value.instance_id == ids[1] and "k-2" in str(err.value)
    with pytest.raises(IdempotencyConflict):  # the same key twice in one batch with other input
        await engine.client.start_many(three, [{"order_id": "o-5"}, {"order_id": "o-6"}],
                                       idempotency_keys=["k-5", "k-5"])
    assert await rows.dump() == before


async def test_business_keys_in_a_batch(engine: Engine, rows: Rows) -> None:
    holder = await engine.client.start(three, {"order_id": "o-1"}, business_key="order-1")
    before = await rows.dump()
    with pytest.raises(BusinessKeyInUse) as err:
        await engine.client.start_many(three, [{"order_id": "o-2"}, {"order_id": "o-1"}],
                                       business_keys=["order-2", "order-1"])
    assert err.value.instance_id == holder and err.value.business_key == "order-1"
    with pytest.raises(InvalidInput, match="more than one item"):
        await engine.client.start_many(three, [{"order_id": "a"}, {"order_id": "b"}], business_keys=["x", "x"])
    with pytest.raises(InvalidInput, match="one entry per input"):
        await engine.client.start_many(three, [{"order_id": "a"}], business_keys=["x", "y"])
    with pytest.raises(InvalidInput, match="item 2 of 2") as refused:
        await engine.client.start_many(three, [{"order_id": "a"}, {"no": "order id"}])
    assert refused.value.item == 2 and (refused.value.item_detail or "").startswith("input for workflow")
    with pytest.raises(PayloadTooLarge) as large:  # the refusal keeps its type and fields in a batch
        await engine.client.start_many(three, [{"order_id": "a"}, {"order_id": "b" * 300_000}])
    assert (large.value.item, large.value.reason, large.value.what) == (2, "too_large", "input")
    assert str(large.value).startswith("item 2 of 2: ")
    assert await rows.dump() == before


async def test_the_pin_is_still_checked(engine: Engine, rows: Rows) -> None:
    await engine.client.start(three, {"order_id": "o-1"})  # registers three v1
    pin = pin_of(three)
    drifted = NewInstances(pin=replace(pin, plan_hash="0" * 64),
                           start_step=three.plan.start, ids=["7c8f1f8e-3a4b-4c5d-8e9f-0a1b2c3d4e5f"],
                           states=[{"order_id": "x"}], business_keys=[None], idempotency_keys=[None],
                           fingerprints=["f"])
    with pytest.raises(DefinitionDrift):
        await engine.store.start_many(drifted)
    assert await rows.count("SELECT count(*) FROM stepstone.instances") == 1


async def test_the_batch_setting_ends_with_the_batch(engine: Engine, rows: Rows) -> None:
    """After a batch, in the same transaction, a single start is admitted and notifies as before."""
    await engine.client.start(three, {"order_id": "o-1"})
    h = pin_of(three).plan_hash
    conn = rows.conn
    async with conn.transaction():
        await conn.execute("SELECT * FROM stepstone.start_batch(ARRAY[gen_random_uuid()], 'default', 'three', 1, $1,"
                           " ARRAY['{\"order_id\": \"b\"}'::jsonb], 'a', ARRAY[NULL::text], ARRAY[NULL::text],"
                           " ARRAY['f'], NULL, NULL, NULL, NULL, NULL)", h)
        assert await conn.fetchval("SELECT current_setting('stepstone.batch', true)") == ""
        with pytest.raises(asyncpg.PostgresError, match="without a version bump"):
            async with conn.transaction():  # a savepoint
                await conn.execute("SELECT stepstone.start_instance(gen_random_uuid(), 'default', 'three', 1, 'bad',"
                                   " '{}', 'a', NULL, NULL, 'f', NULL, NULL)")


async def test_a_batch_wakes_an_idle_worker(engine: Engine, database_url: str) -> None:
    woke = asyncio.Event()
    listener = await engine.store.listen(woke.set)
    try:
        await engine.client.start_many(three, [{"order_id": f"o-{n}"} for n in range(50)])
        await asyncio.wait_for(woke.wait(), timeout=10)
    finally:
        await listener.close()


async def test_sensitive_fields_are_redacted_in_a_batch(database_url: str) -> None:
    from tests.ops import workflows as ops  # noqa: PLC0415 - the sensitive workflow of the redaction tests

    async with open_engine(database_url, ops.registry, concurrency=2) as engine:
        ids = await engine.client.start_many(
            ops.payment, [{"order": f"o-{n}", "card": ops.SECRET, "holder": {"name": "Ann", "pin": "1234"}}
                          for n in range(3)])
        conn = await asyncpg.connect(database_url)
        try:
            history = json.dumps([dict(r) for r in await conn.fetch(
                "SELECT data FROM stepstone.history WHERE instance_id = ANY ($1::uuid[])", ids)], default=str)
            live = await conn.fetchval("SELECT state FROM stepstone.instances WHERE id = $1::uuid", ids[0])
        finally:
            await conn.close()
        assert "canary" not in history and "1234" not in history and "[redacted]" in history
        assert ops.SECRET in live  # the live state keeps the value, as after a single start


async def test_flow_limits_hold_a_batch(database_url: str) -> None:
    from tests.scheduling.workflows import busy, registry  # noqa: PLC0415

    async with open_engine(database_url, registry, concurrency=2) as engine:
        await engine.client.set_flow_limit(busy, max_running=2)
        await engine.client.start_many(busy, [{} for _ in range(5)])
        conn = await asyncpg.connect(database_url)
        try:
            held = await conn.fetchval("SELECT count(*) FROM stepstone.commands WHERE kind = 'START' "
                                       "AND state = 'DEFERRED' AND last_error LIKE 'FLOW_HELD%'")
        finally:
            await conn.close()
        assert held == 3


async def test_deadlines_are_scheduled_for_each_instance(database_url: str) -> None:
    from tests.sagas import workflows as w  # noqa: PLC0415

    async with open_engine(database_url, w.registry, concurrency=2) as engine:
        ids = await engine.client.start_many(w.waiting, [{}, {}])
        conn = await asyncpg.connect(database_url)
        try:
            spans = await conn.fetch("SELECT deadline_at - created_at AS span FROM stepstone.instances "
                                     "WHERE id = ANY ($1::uuid[])", ids)
        finally:
            await conn.close()
        assert [r["span"].total_seconds() for r in spans] == [3600.0, 3600.0]
