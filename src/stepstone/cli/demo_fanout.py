"""``stepstone demo fanout``: a fork of ten branches that each take a second, then a child workflow.

The worker runs with ten slots, so the branches run at once: the fan-out takes about one second,
not ten. The figures it prints are read from the instance's committed history.
"""

from __future__ import annotations

import secrets
import time

import click

from stepstone.cli.common import CliError, run_async, with_settings
from stepstone.client import Client
from stepstone.config import Settings
from stepstone.core.model import COMPLETED
from stepstone.examples import fanout
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.port import Store

_DEADLINE = 60.0


async def run_fanout(store: Store) -> None:
    branches = len(fanout.REGIONS)
    worker = Worker(store, fanout.registry, WorkerConfig(concurrency=branches, poll_interval=0.2))
    await worker.start()
    try:
        client = Client(store, fanout.registry)
        order_id = f"o-{secrets.token_hex(3)}"
        started = time.perf_counter()
        instance_id = await client.start(fanout.shipping, fanout.Shipment(order_id=order_id))
        click.echo(f"[shipping {order_id}] instance {instance_id}: fork of {branches} branches")
        try:
            info = await client.wait_for(instance_id, timeout=_DEADLINE)
        finally:
            await client.detach()
        elapsed = time.perf_counter() - started
    finally:
        await worker.stop(drain_timeout=5.0)
    if info.status != COMPLETED:
        raise CliError(f"shipping {instance_id} ended {info.status}: {info.error}")
    history = await client.history(instance_id)
    joined = [h for h in history if h["kind"] == "JOINED"]
    child = await client.get(str(info.state["invoice_id"]))
    click.echo(f"[shipping {order_id}] {len(info.state['shipments'])} parcels, join fired {len(joined)} time(s); "
               f"invoice {info.state['invoice_number']}")
    click.echo(f"fanout: {branches} branches x {fanout.SHIP_SECONDS:.1f} s in {elapsed:.2f} s; "
               f"child {child.id} {child.status.lower()}")


async def _demo_fanout(settings: Settings) -> None:
    from stepstone.cli.demo import on_migrated_store  # noqa: PLC0415 - demo imports this module's command

    await on_migrated_store(settings, run_fanout)


@click.command("fanout")
@with_settings
def demo_fanout_command(settings: Settings) -> None:
    """A fork of 10 branches that each take 1 s (about 1 s in all with 10 slots), then a child workflow."""
    run_async(_demo_fanout(settings))
