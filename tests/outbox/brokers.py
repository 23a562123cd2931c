"""The brokers the conformance suite runs against, each behind one small interface.

    in-memory   always
    webhook     a local HTTP server in this process (a thread), always
    redis       STEPSTONE_TEST_REDIS_URL   (e.g. redis://127.0.0.1:6379)
    nats        STEPSTONE_TEST_NATS_URL    (e.g. nats://127.0.0.1:4222, JetStream enabled)
    rabbitmq    STEPSTONE_TEST_AMQP_URL    (e.g. amqp://guest:guest@127.0.0.1:5672/)

Every kind routes one test's events to names of its own (`t<hex>...`) and removes them afterwards.
`read()` answers what the broker holds as (event id, key) pairs, in an order that is the broker's
order within each key. `poison(key)` makes the broker refuse the key's `poison.*` events for good
(for Redis: every event of the key) until `cure(key)`.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from stepstone.outbox.publisher import InMemoryBroker

Seen = tuple[str, str | None, str | None]
"""(event id, key, traceparent) of one message the broker holds."""

ENV = {"redis": "STEPSTONE_TEST_REDIS_URL", "nats": "STEPSTONE_TEST_NATS_URL", "rabbitmq": "STEPSTONE_TEST_AMQP_URL"}
KINDS = ("memory", "webhook", "redis", "nats", "rabbitmq")


def with_port(url: str, host: str, port: int) -> str:
    """`url` with its host and port replaced (credentials kept)."""
    parts = urlsplit(url)
    creds = parts.netloc.rpartition("@")[0]
    netloc = f"{creds}@{host}:{port}" if creds else f"{host}:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@dataclass
class Kind:
    name: str
    tag: str
    base_url: str
    """The broker's own URL (host and port), before this test's routing options."""
    url_for: Callable[[str], str]
    """The publisher URL for a given base URL (so a test can route through a proxy)."""
    read: Callable[[], Awaitable[list[Seen]]]
    poison: Callable[[str], Awaitable[None]]
    cure: Callable[[str], Awaitable[None]]
    cleanup: Callable[[], Awaitable[None]]
    dedups: bool = False
    """The broker drops a republished event id itself (JetStream's Nats-Msg-Id)."""
    memory: InMemoryBroker | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.url_for(self.base_url)

    @property
    def endpoint(self) -> tuple[str, int]:
        parts = urlsplit(self.base_url)
        return parts.hostname or "127.0.0.1", int(parts.port or 0)


async def open_kind(name: str) -> Kind:
    tag = f"t{uuid.uuid4().hex[:10]}"
    if name == "memory":
        return _memory(tag)
    if name == "webhook":
        return _webhook(tag)
    url = os.environ.get(ENV[name])
    if not url:
        pytest.skip(f"{ENV[name]} is not set: no {name} broker to test against (.ci/run sets it when one answers)")
    return await {"redis": _redis, "nats": _nats, "rabbitmq": _rabbitmq}[name](tag, url)


def _pairs(messages: list[Any]) -> list[Seen]:
    return [(m.event_id, m.key, m.headers.get("traceparent")) for m in messages]


def _memory(tag: str) -> Kind:
    broker = InMemoryBroker.named(tag)
    poisoned: set[str] = set()
    broker.refuse = lambda e: "poisoned" if e.key in poisoned and e.type.startswith("poison.") else None

    async def read() -> list[Seen]:
        return _pairs(broker.messages)

    async def poison(key: str) -> None:
        poisoned.add(key)

    async def cure(key: str) -> None:
        poisoned.discard(key)

    async def cleanup() -> None:
        InMemoryBroker.forget(tag)

    return Kind("memory", tag, f"memory://{tag}", lambda base: base, read, poison, cure, cleanup, memory=broker)


class _Recorder(BaseHTTPRequestHandler):
    server: _HookServer

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        key = self.headers.get("stepstone-key")
        with self.server.lock:
            self.server.paths.append(self.path)
            refused = key in self.server.poisoned and body["type"].startswith("poison.")
            if not refused:
                self.server.received.append((self.headers["idempotency-key"], key, body, dict(self.headers)))
                self.server.wake()
        self.send_response(422 if refused else 200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        return


class _HookServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Recorder)
        self.lock = threading.Lock()
        self.received: list[tuple[str, str | None, dict[str, Any], dict[str, str]]] = []
        self.poisoned: set[str] = set()
        self.paths: list[str] = []  # each request's path as it came, percent-encoding and all
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def wake(self) -> None:
        """Under `lock`, after a message was recorded: resolve the waits it completes."""
        for count, loop, future in self._waiters:
            if len(self.received) >= count:
                loop.call_soon_threadsafe(_resolve, future)

    async def received_at_least(self, count: int, timeout: float) -> None:
        """Until `count` messages were received (woken by the request that brings the count there)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        waiter = (count, loop, future)
        with self.lock:
            if len(self.received) >= count:
                return
            self._waiters.append(waiter)
        try:
            await asyncio.wait_for(future, timeout)
        finally:
            with self.lock:
                self._waiters.remove(waiter)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _webhook(tag: str) -> Kind:
    server = _HookServer()
    thread = threading.Thread(target=server.serve_forever, name="webhook-test", daemon=True)
    thread.start()

    async def read() -> list[Seen]:
        with server.lock:
            return [(eid, key, headers.get("traceparent")) for eid, key, _, headers in server.received]

    async def poison(key: str) -> None:
        with server.lock:
            server.poisoned.add(key)

    async def cure(key: str) -> None:
        with server.lock:
            server.poisoned.discard(key)

    async def cleanup() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    host, port = server.server_address[:2]
    return Kind("webhook", tag, f"http://{host}:{port}", lambda base: f"{base}/{tag}/{{type}}", read, poison, cure,
                cleanup, extra={"server": server})


async def _redis(tag: str, url: str) -> Kind:
    import redis.asyncio as aioredis  # noqa: PLC0415 - only when a Redis is configured

    client = aioredis.Redis.from_url(url)
    try:
        await client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means: no broker here
        await client.aclose()
        pytest.skip(f"{ENV['redis']}={url} does not answer ({exc})")

    async def read() -> list[Seen]:
        found: list[Seen] = []
        streams = sorted([k async for k in client.scan_iter(match=f"{tag}:*", _type="stream")])
        for stream in streams:
            for _, fields in await client.xrange(stream):
                key = fields[b"key"].decode() or None
                trace = (json.loads(fields[b"body"])["trace_context"] or {}).get("traceparent")
                found.append((fields[b"event_id"].decode(), key, trace))
        return found

    async def poison(key: str) -> None:
        await client.set(f"{tag}:{key}", "not a stream")

    async def cure(key: str) -> None:
        await client.delete(f"{tag}:{key}")

    async def cleanup() -> None:
        keys = [k async for k in client.scan_iter(match=f"{tag}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()

    return Kind("redis", tag, url.split("?", 1)[0], lambda base: f"{base}?stream={tag}:{{key}}", read, poison, cure,
                cleanup)


async def _nats(tag: str, url: str) -> Kind:
    import nats  # noqa: PLC0415 - only when a NATS is configured

    try:
        nc = await nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=1)
        js = nc.jetstream()
        await js.account_info()
    except Exception as exc:  # noqa: BLE001 - any failure means: no JetStream here
        pytest.skip(f"{ENV['nats']}={url} does not answer with JetStream ({exc})")
    stream = tag.upper()
    await js.add_stream(name=stream, subjects=[f"{tag}.ev.>"])

    async def read() -> list[Seen]:
        info = await js.stream_info(stream)
        found: list[Seen] = []
        if not info.state.messages:
            return found
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(stream, seq)
            headers = msg.headers or {}
            found.append((headers["Nats-Msg-Id"], headers.get("stepstone-key"), headers.get("traceparent")))
        return found

    async def poison(_key: str) -> None:
        return  # poison.* subjects are captured by no stream: JetStream has no responder for them

    async def cure(_key: str) -> None:
        await js.update_stream(name=stream, subjects=[f"{tag}.ev.>", f"{tag}.poison.>"])

    async def cleanup() -> None:
        await js.delete_stream(stream)
        await nc.close()

    return Kind("nats", tag, url, lambda base: f"{base}?subject={tag}.{{type}}", read, poison, cure,
                cleanup, dedups=True)


async def _rabbitmq(tag: str, url: str) -> Kind:
    import aio_pika  # noqa: PLC0415 - only when a RabbitMQ is configured

    try:
        conn = await aio_pika.connect(url, timeout=2)
    except Exception as exc:  # noqa: BLE001 - any failure means: no broker here
        pytest.skip(f"{ENV['rabbitmq']}={url} does not answer ({exc})")
    channel = await conn.channel()
    exchange = await channel.declare_exchange(tag, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(tag, durable=True)
    await queue.bind(exchange, "ev.#")
    got: list[Seen] = []

    async def read() -> list[Seen]:
        while True:
            message = await queue.get(no_ack=True, fail=False)
            if message is None:
                return list(got)
            headers = message.headers or {}
            key, trace = headers.get("stepstone-key"), headers.get("traceparent")
            got.append((str(message.message_id), None if key is None else str(key),
                        None if trace is None else str(trace)))

    async def poison(_key: str) -> None:
        return  # poison.* routing keys reach no queue: mandatory publishes come back

    async def cure(_key: str) -> None:
        await queue.bind(exchange, "poison.#")

    async def cleanup() -> None:
        await queue.delete(if_unused=False, if_empty=False)
        await exchange.delete()
        await conn.close()

    base = url.split("?", 1)[0]
    return Kind("rabbitmq", tag, base,
                lambda b: f"{b}{'' if b.endswith('/') else '/'}?exchange={tag}&routing_key={{type}}",
                read, poison, cure, cleanup)


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a broker; `pause()` closes it (connections too), `resume()` reopens
    the same port: a broker that goes away and comes back, for the relay."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}

    async def pause(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.close()
            await self._server.wait_closed()
            self._server = None

    async def resume(self) -> None:
        await self.start()

    async def close(self) -> None:
        await self.pause()
