"""``stepstone demo``: run the example order workflow end to end and narrate what happens.

Every line it prints about the order comes from the instance's committed history, read after the
worker's commits; the demo itself only starts the instance and sends the payment signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import click

from stepstone.cli.common import CliError, run_async, with_settings
from stepstone.cli.connection import open_store
from stepstone.cli.lazy import LazyGroup
from stepstone.client import SETTLED, Client
from stepstone.config import Settings
from stepstone.core.model import COMPLETED, WAITING
from stepstone.examples import orders
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store import migrate as migrations
from stepstone.store.database import connect, redact_url, resolve_target
from stepstone.store.port import Store

__all__ = ["commands", "narrate"]

_DEADLINE = 60.0


def _completed(step: str, data: dict[str, Any]) -> str:
    attempt = data.get("attempt", 1)
    return f"step {step} completed" + (f" (attempt {attempt})" if attempt > 1 else "")


def _waiting(step: str, data: dict[str, Any]) -> str:
    if data.get("kind") == "timer":
        delay = data.get("delay_seconds")
        return f"waiting at timer {step}" + (f" ({delay:g} s)" if delay is not None else "")
    if data.get("kind") == "signal":
        return f"waiting at {step} for signal {' or '.join(sorted(data.get('signals') or {}))}"
    return f"waiting at {step}"


_NARRATION: dict[str, Callable[[str, dict[str, Any]], str]] = {
    "INSTANCE_STARTED": lambda step, _: f"started at step {step}",
    "STEP_COMPLETED": _completed,
    "STEP_FAILED": lambda step, data: f"step {step} failed: {data.get('error') or data}",
    "WAITING": _waiting,
    "TIMER_FIRED": lambda step, _: f"timer {step} fired",
    "SIGNAL_APPLIED": lambda step, data: f"signal {data.get('signal')} accepted at {step}",
    "INSTANCE_COMPLETED": lambda _, __: "instance completed",
}


def narrate(entry: dict[str, Any]) -> str:
    """One history entry in words."""
    kind, step, data = str(entry["kind"]), entry["step"], entry["data"]
    describe = _NARRATION.get(kind)
    if describe is not None:
        return describe(step, data if isinstance(data, dict) else {})
    return kind.lower().replace("_", " ") + (f" at {step}" if step else "")


async def _migrate(settings: Settings) -> str:
    target = await asyncio.to_thread(resolve_target, settings)
    conn = await connect(target)
    try:
        applied = await migrations.migrate(conn, settings.schema)
    finally:
        await conn.close()
    schema = f"schema {settings.schema}: " + (f"applied {len(applied)} migration(s)" if applied else "up to date")
    return f"database {redact_url(target.url)}, {schema}"


async def on_migrated_store(settings: Settings, run: Callable[[Store], Awaitable[None]]) -> None:
    """Migrate the configured (or embedded) database, say so, and run a demo on a store over it."""
    click.echo(await _migrate(settings))
    async with open_store(settings) as store:
        await run(store)


async def _demo(settings: Settings) -> None:
    click.echo(await _migrate(settings))
    async with open_store(settings) as store:
        worker = Worker(store, orders.registry, WorkerConfig(concurrency=4, poll_interval=0.5))
        await worker.start()
        try:
            await _run_order(Client(store, orders.registry), worker)
        finally:
            await worker.stop(drain_timeout=5.0)


async def _run_order(client: Client, worker: Worker) -> None:
    order_id = f"o-{secrets.token_hex(3)}"
    order = orders.Order(order_id=order_id, customer="ada@example.com",
                         lines=[orders.OrderLine(sku="book-42", quantity=1)])
    tag = f"[order {order_id}]"
    instance_id = await client.start(orders.orders, order, business_key=order_id)
    click.echo(f"{tag} instance {instance_id} (workflow {orders.orders.id} v{orders.orders.version})")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _DEADLINE
    printed, paid = 0, False
    while True:
        seen = worker.events.commits
        # Status before history: once it reads settled, the history read after it holds every entry.
        info = await client.get(instance_id)
        history = await client.history(instance_id)
        for entry in history[printed:]:
            click.echo(f"{tag} {narrate(entry)}")
        printed = len(history)
        if info.status in SETTLED:
            break
        if info.status == WAITING and info.step == "await_payment" and not paid:
            payload = {"payment_id": f"pay-{order_id}", "amount": "19.90"}
            await client.signal(instance_id, "payment_received", payload, dedup_key=f"payment/{order_id}")
            click.echo(f"{tag} sent signal payment_received {json.dumps(payload)}")
            paid = True
        if loop.time() >= deadline:
            raise CliError(f"{tag} is still {info.status} at {info.step} after {_DEADLINE:g} s")
        with contextlib.suppress(TimeoutError):  # every change the demo waits for is a commit of this worker
            await worker.events.wait_until(lambda: worker.events.commits > seen,  # noqa: B023 - used at once
                                           timeout=max(0.01, min(1.0, deadline - loop.time())))
    if info.status != COMPLETED:
        raise CliError(f"{tag} ended {info.status}: {info.error}")
    state = info.state
    click.echo(f"{tag} done: outcome {state['outcome']}, reservation {state['reservation_id']}, "
               f"payment {state['payment_id']}, shipment {state['shipment_id']}")


@click.group("demo", invoke_without_command=True, cls=LazyGroup, lazy={
    "approval": "demo_approval:demo_approval_command",
    "fanout": "demo_fanout:demo_fanout_command",
    "outbox": "demo_outbox:demo_outbox_command",
    "rolling-deploy": "demo_rolling:demo_rolling_command",
    "saga": "demo_saga:demo_saga_command",
})
@with_settings
@click.pass_context
def demo_command(ctx: click.Context, settings: Settings) -> None:
    """Run the example order workflow (a step, a timer, a signal) on the configured or embedded database.

    `stepstone demo fanout` runs a fork of ten branches and a child workflow (docs/branches.md);
    `stepstone demo outbox` runs the orders with the outbox relay publishing their events (docs/outbox.md);
    `stepstone demo saga` runs a booking saga whose payment fails, compensated in reverse (docs/sagas.md)."""
    if ctx.invoked_subcommand is None:
        run_async(_demo(settings))


commands = [demo_command]
