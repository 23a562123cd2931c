"""``stepstone demo outbox``: the order example with the relay publishing its events, read back from the broker.

Redis Streams at 127.0.0.1:6379 when it answers (and the ``redis`` extra is installed), else the
in-memory broker; ``--broker URL`` picks another. The last line states what was verified by reading
the broker back: how many events arrived, that each key's events are in staged order, and that
nothing is left pending.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import replace

import click

from stepstone.cli.common import CliError, run_async, with_settings
from stepstone.cli.connection import open_store
from stepstone.cli.demo import _migrate, _run_order
from stepstone.client import Client
from stepstone.config import Settings
from stepstone.errors import StepstoneError
from stepstone.examples import orders
from stepstone.outbox import (
    InMemoryBroker,
    InMemoryPublisher,
    Outcome,
    Publisher,
    PublishResult,
    Relay,
    RelayConfig,
    Routing,
    open_publisher,
)
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.outbox import PostgresOutbox, StagedEvent

__all__ = ["demo_outbox_command"]

LOCAL_REDIS = "redis://127.0.0.1:6379"
_PENDING_ROUNDS = 60


async def _redis_answers(url: str) -> bool:
    try:
        import redis.asyncio as aioredis  # noqa: PLC0415 - optional extra
    except ImportError:
        return False
    client = aioredis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(await client.ping())
    except Exception:  # noqa: BLE001 - any failure means: use the in-memory broker
        return False
    finally:
        await client.aclose()


async def _choose(broker: str | None) -> Publisher:
    if broker is None and await _redis_answers(LOCAL_REDIS):
        broker = LOCAL_REDIS
    if broker is None:
        return InMemoryPublisher(InMemoryBroker.named("demo"))
    try:
        publisher = open_publisher(broker)
    except StepstoneError as exc:
        raise CliError(str(exc)) from exc
    if not _readable(publisher):  # said before the order runs and its events go out, not after
        await publisher.close()
        raise CliError(f"the demo reads its events back from the broker, and it can read only Redis or the "
                       f"in-memory broker, not {publisher.name}; to publish there, run `stepstone relay --broker` "
                       "beside your application")
    return publisher


def _readable(publisher: Publisher) -> bool:
    return isinstance(publisher, InMemoryPublisher) or getattr(publisher, "read", None) is not None


class _Recording:
    """The demo's publisher: remembers which events the broker acknowledged."""

    def __init__(self, inner: Publisher) -> None:
        self.inner = inner
        self.name = inner.name
        self.acknowledged: list[str] = []

    async def publish(self, batch: Sequence[StagedEvent]) -> list[PublishResult]:
        results = await self.inner.publish(batch)
        self.acknowledged += [e.event_id for e, r in zip(batch, results, strict=True) if r.outcome is Outcome.OK]
        return results

    async def close(self) -> None:
        await self.inner.close()


async def _read_back(publisher: Publisher, targets: set[str]) -> list[str]:
    """Event ids as the broker holds them, in its order (stream by stream, for Redis)."""
    if isinstance(publisher, InMemoryPublisher):
        return [m.event_id for m in publisher.broker.messages]
    held: list[str] = []
    for stream in sorted(targets):  # a Redis publisher (`_choose` took no other)
        held += [entry["id"] for _, entry in await publisher.read(stream)]  # type: ignore[attr-defined]
    return held


def _in_key_order(staged: list[tuple[int, str, str, str | None]], held: list[str]) -> bool:
    """Each key's events appear in the broker in staged order (first appearance of each)."""
    position: dict[str, int] = {}
    for n, event_id in enumerate(held):
        position.setdefault(event_id, n)
    by_key: dict[str, list[int]] = {}
    for _, event_id, _, key in staged:
        if key is not None:
            by_key.setdefault(key, []).append(position[event_id])
    return all(seq == sorted(seq) for seq in by_key.values())


def _own_schema(settings: Settings) -> Settings:
    """On a configured database the demo works in a schema of its own beside the application's: a relay
    publishes every event of its schema's outbox, so in the application's schema the demo's relay would
    take the application's events (marked published, sent to the demo's broker) and the application's
    relay the demo's (sent to the application's broker). The embedded default is the demos' own database."""
    if settings.database_url is None:
        return settings
    return replace(settings, schema=f"{settings.schema[:58]}_demo")


async def _demo_outbox(settings: Settings, broker: str | None) -> None:
    settings = _own_schema(settings)
    click.echo(await _migrate(settings))
    if settings.database_url is not None:
        click.echo(f"schema {settings.schema} is the demo's own, beside the application's: its relay publishes "
                   f"only the demo's events (`DROP SCHEMA {settings.schema} CASCADE` removes it)")
    recording = _Recording(await _choose(broker))
    try:
        async with open_store(settings, pool_size=8) as store:
            outbox = PostgresOutbox(store)
            await _nothing_else_unpublished(outbox, recording.name, embedded=settings.database_url is None,
                                            schema=settings.schema)
            relay = Relay(outbox, recording, RelayConfig(poll_interval=0.2))
            worker = Worker(store, orders.registry, WorkerConfig(concurrency=4, poll_interval=0.5))
            await relay.start()
            await worker.start()
            try:
                click.echo(f"relay publishing to {recording.name}")
                await _run_order(Client(store, orders.registry), worker)
                await _until_nothing_pending(outbox, relay)
            finally:
                await worker.stop(drain_timeout=5.0)
                await relay.stop()
            await _report(outbox, recording, relay)
    finally:
        await recording.close()


async def _nothing_else_unpublished(outbox: PostgresOutbox, broker: str, *, embedded: bool, schema: str) -> None:
    """The demo's relay publishes whatever its schema's outbox holds. On a configured database that is the
    demo's own schema (`_own_schema`), where only events of the order example belong: anything else was put
    there by something other than the demo, and is not the demo's to publish. The embedded default is the
    demos' own database, where the other demos leave their events pending: all of them go out with the
    demo's. Nowhere may one be dead (the demo waits for every event to go out)."""
    foreign = 0 if embedded else await outbox.unpublished_beside([wf.id for wf in orders.registry])
    dead = (await outbox.status()).dead
    if foreign or dead:
        raise CliError(f"the outbox already holds {foreign} unpublished event(s) of other workflows and {dead} dead "
                       f"event(s): the demo's relay would publish them to {broker} as its own. Run the demo on a "
                       f"database of its own, or see them with `stepstone outbox list --schema {schema}`")


async def _until_nothing_pending(outbox: PostgresOutbox, relay: Relay) -> None:
    """The order's last events were staged by its last commits: wait for the relay's next batches."""
    relay.wake()
    for _ in range(_PENDING_ROUNDS):
        status = await outbox.status()
        if status.dead:
            raise CliError(f"{status.dead} event(s) dead-lettered: see `stepstone outbox list --dead`")
        if not status.pending:
            return
        rounds = relay.events.batches + relay.events.idle
        with contextlib.suppress(TimeoutError):
            await relay.events.wait_until(lambda: relay.events.batches + relay.events.idle > rounds,  # noqa: B023
                                          timeout=1.0)
    raise CliError(f"{(await outbox.status()).pending} event(s) still pending; is the broker answering?")


async def _report(outbox: PostgresOutbox, recording: _Recording, relay: Relay) -> None:
    staged = await outbox.staged_order(recording.acknowledged)
    routing: Routing | None = getattr(recording.inner, "routing", None)

    def target(event_type: str, key: str | None) -> str:
        return recording.name if routing is None else routing.target_of(event_type, key)

    held = await _read_back(recording.inner, {target(t, k) for _, _, t, k in staged})
    missing = set(recording.acknowledged) - set(held)
    if missing:
        raise CliError(f"{len(missing)} acknowledged event(s) are not in {recording.name}")
    if not _in_key_order(staged, held):
        raise CliError(f"{recording.name} holds a key's events out of staged order")
    for _, event_id, event_type, key in staged:
        click.echo(f"published {event_type} (key {key}) to {target(event_type, key)}: event {event_id}")
    pending = (await outbox.status()).pending
    click.echo(f"outbox: {relay.events.published} events published to {recording.name} in per-key order; "
               f"{pending} pending")


@click.command("outbox")
@click.option("--broker", default=None, metavar="URL",
              help=f"A Redis (redis://) or in-memory (memory://) broker to publish to and read back, instead of "
                   f"{LOCAL_REDIS} (or the in-memory broker when Redis does not answer).")
@with_settings
def demo_outbox_command(settings: Settings, broker: str | None) -> None:
    """Run the order example with the outbox relay, read the events back from the broker, check their order."""
    run_async(_demo_outbox(settings, broker))
