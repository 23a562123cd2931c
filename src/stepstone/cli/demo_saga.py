"""``stepstone demo saga``: a booking saga whose payment fails for good, compensated in reverse.

Every line it prints comes from the instance's committed history, read after the worker's commits.
"""

from __future__ import annotations

import secrets

import click

from stepstone.cli.common import CliError, run_async, with_settings
from stepstone.client import Client
from stepstone.config import Settings
from stepstone.core.model import COMPENSATED
from stepstone.examples import booking
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.port import Store

_DEADLINE = 60.0


async def run_saga(store: Store) -> None:
    worker = Worker(store, booking.registry, WorkerConfig(concurrency=2, poll_interval=0.2))
    await worker.start()
    client = Client(store, booking.registry)
    try:
        trip = f"t-{secrets.token_hex(3)}"
        tag = f"[booking {trip}]"
        instance_id = await client.start(booking.booking, booking.Booking(trip_id=trip, traveller="ada"))
        click.echo(f"{tag} instance {instance_id} (workflow {booking.booking.id} v{booking.booking.version})")
        info = await client.wait_for(instance_id, timeout=_DEADLINE)
        history = await client.history(instance_id)
    finally:
        await client.detach()
        await worker.stop(drain_timeout=5.0)
    failed = next((h for h in history if h["kind"] == "STEP_FAILED"), None)
    for entry in history:
        data = entry["data"] if isinstance(entry["data"], dict) else {}
        if entry["kind"] == "STEP_COMPLETED":
            click.echo(f"{tag} step {entry['step']} completed")
        elif entry["kind"] == "STEP_FAILED":
            click.echo(f"{tag} step {entry['step']} failed: {data.get('type')}: {data.get('message')}")
        elif entry["kind"] == "COMPENSATION_STARTED":
            click.echo(f"{tag} compensating the completed steps in reverse order")
        elif entry["kind"] == "STEP_COMPENSATED":
            click.echo(f"{tag} compensated {entry['step']} (attempt {data.get('attempt')})")
    if info.status != COMPENSATED or failed is None:
        raise CliError(f"booking {instance_id} ended {info.status}: {info.error}")
    compensated = [h["step"] for h in history if h["kind"] == "STEP_COMPENSATED"]
    click.echo(f"saga: {info.status} after {failed['step']} failed; compensated {', '.join(compensated)}")


@click.command("saga")
@with_settings
def demo_saga_command(settings: Settings) -> None:
    """A booking saga (flight, hotel, card) whose payment fails for good; prints the compensations in order."""
    from stepstone.cli.demo import on_migrated_store  # noqa: PLC0415 - the demo group imports this command

    run_async(on_migrated_store(settings, run_saga))
