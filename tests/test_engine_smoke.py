"""First end-to-end checks of the durable loop against real PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from pydantic import BaseModel

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.client import Client
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.postgres import PostgresStore


class Order(BaseModel):
    order_id: str
    log: list[str] = []


wf: Workflow[Order] = Workflow("order", version=1, state=Order)


@wf.step(start=True, next="pause")
def reserve(ctx: StepContext, state: Order) -> None:
    state.log.append("reserve")


wf.timer("pause", delay=timedelta(minutes=5), next="await_payment")
wf.wait("await_payment", signals={"paid": "ship"}, timeout=timedelta(days=1), on_timeout="ship")


@wf.step(next=None)
async def ship(ctx: StepContext, state: Order) -> None:
    state.log.append(f"ship:{ctx.signal.payload if ctx.signal else 'timeout'}")
    ctx.emit("order.shipped", {"order": state.order_id}, key=state.order_id)


registry = Registry(wf)


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[PostgresStore]:
    s = await PostgresStore.open(database_url)
    yield s
    await s.close()


async def test_order_runs_through_timer_and_signal(store: PostgresStore) -> None:
    client = Client(store, registry)
    worker = Worker(store, registry, WorkerConfig(concurrency=2))
    await worker.register()
    iid = await client.start(wf, {"order_id": "o-1"})
    await worker.run_until_idle()
    info = await client.get(iid)
    assert info.status == "WAITING" and info.step == "pause"
    await store.move_clock(301)
    await worker.run_until_idle()
    info = await client.get(iid)
    assert info.status == "WAITING" and info.step == "await_payment"
    await client.signal(iid, "paid", {"amount": 3})
    await worker.run_until_idle()
    info = await client.get(iid)
    assert info.status == "COMPLETED", info
    assert info.state["log"] == ["reserve", "ship:{'amount': 3}"]
    kinds = [h["kind"] for h in await client.history(iid)]
    assert kinds == [
        "INSTANCE_STARTED", "STEP_COMPLETED", "WAITING", "TIMER_FIRED", "WAITING",
        "SIGNAL_APPLIED", "STEP_COMPLETED", "INSTANCE_COMPLETED",
    ]


untyped: Workflow[dict[str, int]] = Workflow("untyped", version=1)


@untyped.step(start=True)
def count(ctx: StepContext, state: dict[str, int]) -> None:
    state["n"] = state.get("n", 0) + 1


async def test_workflow_without_state_model_keeps_handler_changes(store: PostgresStore) -> None:
    reg = Registry(untyped)
    client = Client(store, reg)
    worker = Worker(store, reg)
    await worker.register()
    iid = await client.start(untyped, {"n": 41})
    await worker.run_until_idle()
    info = await client.get(iid)
    assert info.status == "COMPLETED"
    assert info.state == {"n": 42}
