"""Workflows run on while the broker is down, and nothing is lost once it is back.

Instances emit events through the engine (real step commits) while the relay publishes to a port
nobody listens on; every instance completes, every event waits in the outbox, no attempt is counted
against it. Then a relay on the real broker (the one on this machine when its URL is set) publishes
them all, each key in staged order. (Event types start with `ev.`: what every broker kind of the
conformance suite routes, tests/outbox/brokers.py.)
"""

from __future__ import annotations

import socket
from typing import Any

import asyncpg

from stepstone import Registry, StepContext, Workflow
from stepstone.outbox.publisher import open_publisher
from stepstone.outbox.relay import Relay, RelayConfig
from stepstone.store.outbox import PostgresOutbox
from stepstone.testing import open_engine
from tests.outbox.brokers import Kind, with_port
from tests.outbox.test_conformance import assert_keys_in_order, drain

flow: Workflow[dict[str, Any]] = Workflow("broker_down_order", version=1)


@flow.step(start=True, next="pay")
def reserve(ctx: StepContext, state: dict[str, Any]) -> None:
    ctx.emit("ev.reserved", {"order": state["order"]}, key=state["order"])


@flow.step(next="ship")
def pay(ctx: StepContext, state: dict[str, Any]) -> None:
    ctx.emit("ev.paid", {"order": state["order"]}, key=state["order"])
    ctx.emit("ev.audit", {"order": state["order"]})  # no key: no order asked


@flow.step
def ship(ctx: StepContext, state: dict[str, Any]) -> None:
    ctx.emit("ev.shipped", {"order": state["order"]}, key=state["order"])


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_workflows_run_while_the_broker_is_down_and_nothing_is_lost(
    kind: Kind, conn: asyncpg.Connection, outbox: PostgresOutbox, database_url: str
) -> None:
    if kind.memory is None:
        down_url = kind.url_for(with_port(kind.base_url, "127.0.0.1", _closed_port()))
    else:
        kind.memory.down = True
        down_url = kind.url
    orders = [f"o-{n}" for n in range(12)]
    async with open_engine(database_url, Registry(flow), concurrency=4) as engine:
        down = open_publisher(down_url)
        relay = Relay(outbox, down, RelayConfig(poll_interval=0.05, max_attempts=2))
        await relay.start()
        try:
            ids = [await engine.client.start(flow, {"order": o}) for o in orders]
            await engine.run_until_idle()
            relay.wake()
            await relay.events.wait_until(lambda: relay.events.unavailable >= 2)
            assert {(await engine.client.get(i)).status for i in ids} == {"COMPLETED"}  # instances go on
            status = await outbox.status()
            assert (status.pending, status.dead) == (4 * len(orders), 0)  # events wait, none dead
            assert {r.attempts for r in await outbox.unpublished(limit=1000)} == {0}  # nothing counted
        finally:
            await relay.stop()
            await down.close()

    if kind.memory is not None:
        kind.memory.down = False
    up = open_publisher(kind.url)
    back = Relay(outbox, up, RelayConfig(poll_interval=0.05))
    try:
        await drain([back], outbox)
    finally:
        await up.close()
    staged = [(r["id"], r["event_id"], r["key"]) for r in await conn.fetch(
        "SELECT id, event_id::text, key FROM stepstone.outbox ORDER BY id")]
    seen = await kind.read()
    assert {e for e, _, _ in seen} == {e for _, e, _ in staged}  # every event arrived
    assert_keys_in_order(seen, staged)  # each order's events in the order its steps committed them
    assert (await outbox.status()).pending == 0
