"""The order example: every path through it, with the database clock moved instead of waiting."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from stepstone.client import Client
from stepstone.examples import orders
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.postgres import PostgresStore

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[tuple[Client, Worker, PostgresStore]]:
    store = await PostgresStore.open(database_url)
    worker = Worker(store, orders.registry, WorkerConfig(concurrency=2))
    await worker.register()
    yield Client(store, orders.registry), worker, store
    await store.close()


def new_order(order_id: str, sku: str = "book-42") -> orders.Order:
    return orders.Order(order_id=order_id, customer="ada@example.com",
                        lines=[orders.OrderLine(sku=sku, quantity=1)])


async def to_payment_wait(engine: tuple[Client, Worker, PostgresStore], order_id: str, sku: str = "book") -> str:
    client, worker, store = engine
    instance_id = await client.start(orders.orders, new_order(order_id, sku), business_key=order_id)
    await worker.run_until_idle()
    info = await client.get(instance_id)
    assert (info.status, info.step) == ("WAITING", "cooling_off")
    assert info.state["reservation_id"] in orders.warehouse.held
    await store.move_clock(orders.COOLING_OFF.total_seconds() + 1)
    await worker.run_until_idle()
    info = await client.get(instance_id)
    assert (info.status, info.step) == ("WAITING", "await_payment")
    return instance_id


async def test_paid_order_ships(engine: tuple[Client, Worker, PostgresStore]) -> None:
    client, worker, _ = engine
    instance_id = await to_payment_wait(engine, "o-paid")
    await client.signal(instance_id, "payment_received", {"payment_id": "pay-1"})
    await worker.run_until_idle()
    info = await client.get(instance_id)
    assert info.status == "COMPLETED"
    assert info.state["outcome"] == "shipped"
    assert info.state["payment_id"] == "pay-1"
    assert info.state["shipment_id"] == "ship-o-paid"
    steps = [h["step"] for h in await client.history(instance_id) if h["kind"] == "STEP_COMPLETED"]
    assert steps == ["reserve_stock", "ship", "send_receipt"]


@pytest.mark.parametrize("payload", [None, "pay-2", ["pay-2"]])
async def test_a_payment_signal_without_a_payment_id_still_ships(
    engine: tuple[Client, Worker, PostgresStore], payload: object,
) -> None:
    """`stepstone signal ID payment_received` without --payload sends None: `ship` failed on it with an
    AttributeError, retried as if transient."""
    client, worker, _ = engine
    instance_id = await to_payment_wait(engine, "o-no-payload")
    await client.signal(instance_id, "payment_received", payload)
    await worker.run_until_idle()
    info = await client.get(instance_id)
    assert (info.status, info.state["outcome"], info.state["payment_id"]) == ("COMPLETED", "shipped", None)


async def test_cancelled_order_releases_stock(engine: tuple[Client, Worker, PostgresStore]) -> None:
    client, worker, _ = engine
    instance_id = await to_payment_wait(engine, "o-cancel")
    await client.signal(instance_id, "order_cancelled")
    await worker.run_until_idle()
    info = await client.get(instance_id)
    assert (info.status, info.state["outcome"]) == ("COMPLETED", "cancelled")
    assert info.state["reservation_id"] not in orders.warehouse.held


async def test_unpaid_order_times_out(engine: tuple[Client, Worker, PostgresStore]) -> None:
    client, worker, store = engine
    instance_id = await to_payment_wait(engine, "o-unpaid")
    await store.move_clock(timedelta(days=1).total_seconds() + 1)
    await worker.run_until_idle()
    info = await client.get(instance_id)
    assert (info.status, info.state["outcome"]) == ("COMPLETED", "payment timed out")


async def test_out_of_stock_fails_without_retrying(engine: tuple[Client, Worker, PostgresStore]) -> None:
    client, worker, _ = engine
    instance_id = await client.start(orders.orders, new_order("o-oos", sku="out-of-stock"))
    await worker.run_until_idle()
    info = await client.get(instance_id)
    assert info.status == "FAILED"
    assert info.error["type"] == "OutOfStock"
    assert info.error["attempt"] == 1


def test_a_repeated_reservation_returns_the_first() -> None:
    warehouse = orders.Warehouse()
    lines = [orders.OrderLine(sku="a", quantity=1)]
    first = warehouse.reserve("instance/reserve_stock/1", lines)
    assert warehouse.reserve("instance/reserve_stock/1", lines) == first
    assert warehouse.reserve("instance/reserve_stock/2", lines) != first
    warehouse.release(first)
    warehouse.release(first)
    assert first not in warehouse.held


def test_the_authoring_guide_shows_the_example_verbatim() -> None:
    guide = (ROOT / "docs" / "authoring.md").read_text(encoding="utf-8")
    source = (ROOT / "src" / "stepstone" / "examples" / "orders.py").read_text(encoding="utf-8")
    assert f"```python\n{source}```" in guide, "docs/authoring.md must contain examples/orders.py unchanged"


def test_the_branches_guide_shows_the_fanout_example_verbatim() -> None:
    guide = (ROOT / "docs" / "branches.md").read_text(encoding="utf-8")
    source = (ROOT / "src" / "stepstone" / "examples" / "fanout.py").read_text(encoding="utf-8")
    assert f"```python\n{source}```" in guide, "docs/branches.md must contain examples/fanout.py unchanged"
