"""Relay: throughput to each broker that answers here, and commit -> broker-ack lag at 50% of that rate.

    throughput  N events staged up front (keys cycling over 100), one relay (batch 500) publishes them
                all; events/s = N / wall time from its first claim to its last settle
    lag         an open loop stages events in commits of STAGE_PER_COMMIT at half the measured rate,
                a relay service publishes them; per event, from the moment its staging commit returned
                to the moment the publish call carrying it returned acknowledged (one process, one
                monotonic clock). Inserts stand in for step commits (the same table, trigger and xid).

Brokers: the in-memory one always; Redis 127.0.0.1:6379, NATS 127.0.0.1:4222 (JetStream) and RabbitMQ
127.0.0.1:5672 when they answer; a webhook to a threaded HTTP server in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from stepstone.bench.common import BenchContext, Metric, bench_database, bench_queries, percentile
from stepstone.outbox.publisher import Outcome, Publisher, PublishResult, open_publisher
from stepstone.outbox.relay import Relay, RelayConfig
from stepstone.store.outbox import PostgresOutbox, StagedEvent
from stepstone.store.postgres import PostgresStore

KEYS = 100
STAGE_PER_COMMIT = 10
EVENT_TYPE = "bench.made"


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.5).close()
    except OSError:
        return False
    return True


@asynccontextmanager
async def _broker(name: str, tag: str) -> AsyncIterator[str]:
    """The publisher URL of broker `name` for this run, with what it needs set up and removed after."""
    if name == "memory":
        yield f"memory://{tag}"
    elif name == "redis":
        import redis.asyncio as aioredis  # noqa: PLC0415 - optional extra, only when Redis answers

        client = aioredis.Redis.from_url("redis://127.0.0.1:6379")
        try:
            yield f"redis://127.0.0.1:6379?stream={tag}:{{category}}&maxlen=0"
        finally:
            await client.delete(f"{tag}:bench")
            await client.aclose()
    elif name == "nats":
        import nats  # noqa: PLC0415 - optional extra, only when NATS answers

        try:
            yield f"nats://127.0.0.1:4222?subject={tag}.{{type}}&stream={tag.upper()}"
        finally:
            nc = await nats.connect("nats://127.0.0.1:4222")
            with contextlib.suppress(Exception):
                await nc.jetstream().delete_stream(tag.upper())
            await nc.close()
    elif name == "rabbitmq":
        import aio_pika  # noqa: PLC0415 - optional extra, only when RabbitMQ answers

        conn = await aio_pika.connect("amqp://guest:guest@127.0.0.1:5672/")
        channel = await conn.channel()
        exchange = await channel.declare_exchange(tag, aio_pika.ExchangeType.TOPIC, durable=True)
        queue = await channel.declare_queue(tag, durable=True)
        await queue.bind(exchange, "#")
        try:
            yield f"amqp://guest:guest@127.0.0.1:5672/?exchange={tag}"
        finally:
            await queue.delete(if_unused=False, if_empty=False)
            await exchange.delete()
            await conn.close()
    else:  # a receiver in its own process, so the number measures the publisher, not a GIL shared with it
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "stepstone.bench.relay", "receiver", stdout=asyncio.subprocess.PIPE)
        try:
            assert proc.stdout is not None
            port = int((await proc.stdout.readline()).decode())
            yield f"http://127.0.0.1:{port}/events"
        finally:
            proc.terminate()
            await proc.wait()


def brokers() -> list[str]:
    """The brokers measured: in-memory, those answering on their usual local port, and a local webhook."""
    found = ["memory"]
    found += [name for name, port in (("redis", 6379), ("nats", 4222), ("rabbitmq", 5672)) if _answers(port)]
    return [*found, "webhook"]


class _Timed:
    """Records when each acknowledged event's publish call returned."""

    def __init__(self, inner: Publisher) -> None:
        self.inner = inner
        self.name = inner.name
        self.acked: dict[str, float] = {}

    async def publish(self, batch: Sequence[StagedEvent]) -> list[PublishResult]:
        results = await self.inner.publish(batch)
        now = time.monotonic()
        for event, result in zip(batch, results, strict=True):
            if result.outcome is Outcome.OK:
                self.acked.setdefault(event.event_id, now)
        return results

    async def close(self) -> None:
        await self.inner.close()


async def run(ctx: BenchContext) -> list[Metric]:
    metrics: list[Metric] = []
    count = 5_000 if ctx.sizes.name == "quick" else 20_000
    seconds = 3.0 if ctx.sizes.name == "quick" else 10.0
    for name in brokers():
        tag = f"stepstonebench{uuid.uuid4().hex[:8]}"
        async with _broker(name, tag) as url, bench_database(ctx) as db:
            store = await PostgresStore.open(db, ctx.schema, max_size=8)
            try:
                rate = await _throughput(ctx, store, url, count)
                lags = await _lag(ctx, store, url, 0.5 * rate, seconds)
            finally:
                await store.close()
        p50, p99 = percentile(lags, 50), percentile(lags, 99)
        ctx.say(f"relay to {name}: {rate:,.0f} events/s; lag at {0.5 * rate:,.0f}/s p50 {p50 or 0:.1f} ms "
                f"p99 {p99 or 0:.1f} ms ({len(lags)} events)")
        note = f"{len(lags)} events at {0.5 * rate:,.0f}/s (50% of max), commits of {STAGE_PER_COMMIT}"
        metrics += [
            Metric("relay", f"{name}: throughput", rate, "events/s", note=f"{count} events, batch 500, one relay"),
            Metric("relay", f"{name}: commit->ack lag p50", p50, "ms", note=note),
            Metric("relay", f"{name}: commit->ack lag p99", p99, "ms", note=note),
        ]
    return metrics


async def _throughput(ctx: BenchContext, store: PostgresStore, url: str, count: int) -> float:
    await store.pool.execute(bench_queries(ctx.schema)["stage_events"], count, KEYS, EVENT_TYPE)
    publisher = open_publisher(url)
    relay = Relay(PostgresOutbox(store), publisher, RelayConfig(relay_id="bench", poll_interval=0.05))
    try:
        started = time.perf_counter()
        await relay.start()  # a service: a transaction elsewhere on the server may hold the horizon a moment
        await relay.events.wait_until(lambda: relay.events.published >= count, timeout=300)
        elapsed = time.perf_counter() - started
    finally:
        await relay.stop()
        await publisher.close()
    return count / elapsed


async def _lag(ctx: BenchContext, store: PostgresStore, url: str, rate: float, seconds: float) -> list[float]:
    query = bench_queries(ctx.schema)["stage_events"]
    publisher = _Timed(open_publisher(url))
    relay = Relay(PostgresOutbox(store), publisher, RelayConfig(relay_id="bench-lag", poll_interval=0.5))
    committed: dict[str, float] = {}
    await relay.start()
    try:
        commits = max(1, int(rate * seconds / STAGE_PER_COMMIT))
        origin = time.monotonic()
        for i in range(commits):
            delay = origin + i * STAGE_PER_COMMIT / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            rows = await store.pool.fetch(query, STAGE_PER_COMMIT, KEYS, EVENT_TYPE)
            now = time.monotonic()
            committed.update((r["event_id"], now) for r in rows)
        await relay.events.wait_until(lambda: len(publisher.acked) >= len(committed), timeout=120)
    finally:
        await relay.stop()
        await publisher.close()
    return [(publisher.acked[e] - at) * 1000 for e, at in committed.items()]


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """HTTP/1.1 keep-alive: read each request (headers, then content-length bytes), answer 200."""
    try:
        while head := await reader.readuntil(b"\r\n\r\n"):
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def _receiver() -> None:
    """A webhook receiver answering 200 to every POST; prints its port, serves until terminated."""
    server = await asyncio.start_server(_answer, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)  # noqa: T201 - the parent reads the port
    await server.serve_forever()


if __name__ == "__main__" and sys.argv[1:] == ["receiver"]:
    asyncio.run(_receiver())
