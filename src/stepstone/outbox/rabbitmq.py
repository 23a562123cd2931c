"""RabbitMQ publisher (extra ``stepstone[rabbitmq]``): publisher confirms, mandatory, persistent.

    amqp://guest:guest@host:5672/vhost?exchange=stepstone&routing_key={type}&concurrency=64

The exchange (a durable topic exchange, declared if missing) receives every event with the routing
key from the template. Messages are persistent (delivery mode 2) with ``message_id`` = the event id
(the consumer's dedup id: RabbitMQ does not deduplicate) and the event id, type, key and trace
context as headers. An event counts as published when the broker confirms it (Basic.Ack); a
message no queue is bound for comes back (mandatory) and is refused, a nack is a transient failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange

from stepstone.errors import BrokerMisconfigured, BrokerUnavailable
from stepstone.outbox.publisher import (
    MAX_CONCURRENCY,
    PublishResult,
    Routing,
    body_of,
    headers_of,
    publish_in_lanes,
    query_options,
    whole_option,
)
from stepstone.store.database import redact_url
from stepstone.store.outbox import StagedEvent

__all__ = ["RabbitMqPublisher", "amqp_publisher"]

log = logging.getLogger("stepstone.outbox.rabbitmq")

DEFAULT_EXCHANGE = "stepstone"
DEFAULT_ROUTING_KEY = "{type}"
MAX_SHORT_STRING_BYTES = 255
"""AMQP 0-9-1 carries a routing key and the `type` property as short strings: a longer one the client
cannot encode at all (a routing key that long is refused; a type that long is left out of the property)."""
PROBE_SECONDS = 2.0
"""How long the broker has to answer on the connection when a confirm did not come: no answer is the
broker unreachable."""
_OURS = ("exchange", "routing_key", "concurrency")
_CLIENTS = frozenset({  # what aiormq and aio_pika read from the URL's query: passed on to them
    "auth", "cafile", "cadata", "capath", "certfile", "keyfile", "no_verify_ssl", "heartbeat", "name", "timeout",
    "interleave", "happy_eyeballs_delay", "reconnect_interval", "fail_fast"})
_REFUSED_SETUP = (aiormq.exceptions.ChannelPreconditionFailed, aiormq.exceptions.ChannelAccessRefused)
"""What the broker answers a declaration it will not make: another exchange of that name and another
type or arguments (406), or a user without the right to declare it (403)."""
_CREDENTIALS_REFUSED = (aiormq.exceptions.ProbableAuthenticationError, aiormq.exceptions.AuthenticationError)
"""A login the broker refuses (ACCESS_REFUSED, or no mechanism both sides know): the configuration's."""
_UNREACHABLE = (aiormq.exceptions.AMQPConnectionError, aiormq.exceptions.ChannelInvalidStateError, ConnectionError,
                OSError)


class _ForcedCloses(logging.Filter):
    """aiormq says a connection the broker closes (an operator's close, a node going down) as an ERROR and
    then a WARNING with the traceback of the reader task, though the publisher only connects again for the
    next batch. For the publishers' own connections both become one WARNING line of ours; other aiormq
    connections of the process are left as they are."""

    def __init__(self) -> None:
        super().__init__()
        self.ours: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()  # -> publisher name
        self.closed: set[tuple[Any, ...]] = set()  # (reply code, text) said, whose reader's end is still to come

    def watch(self, connection: object, name: str) -> None:
        if self not in logging.getLogger("aiormq.connection").filters:
            logging.getLogger("aiormq.connection").addFilter(self)
        self.ours[connection] = name

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if str(record.msg).startswith("Unexpected connection close from remote") and len(args) == 3:
            name = self.ours.get(args[0])
            if name is None:
                return True
            self.closed.add(tuple(args[1:]))
            log.warning("RabbitMQ closed the outbox publisher's connection to %s (%s %s); it connects again for "
                        "the next batch", name, args[1], args[2])
            return False
        error = record.exc_info[1] if record.exc_info else None
        if record.msg == "Cancelling cause reader exited abnormally" and isinstance(
                error, aiormq.exceptions.ConnectionClosed) and tuple(error.args[:2]) in self.closed:
            self.closed.discard(tuple(error.args[:2]))
            return False
        return True


_FORCED_CLOSES = _ForcedCloses()


class RabbitMqPublisher:
    def __init__(self, url: str, *, exchange: str = DEFAULT_EXCHANGE, routing: Routing | None = None,
                 concurrency: int = 64, timeout: float = 5.0) -> None:
        self.url = url
        self.name = redact_url(url.split("?", 1)[0])
        self.exchange_name = exchange
        self.routing = routing or Routing(DEFAULT_ROUTING_KEY)
        self.concurrency = concurrency
        self.timeout = timeout
        self._conn: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None

    async def _connect(self) -> AbstractExchange:
        if self._exchange is not None and self._channel is not None and not self._channel.is_closed:
            return self._exchange
        await self._drop()
        conn: AbstractConnection | None = None
        try:
            conn = await aio_pika.connect(self.url, timeout=2.0)
            channel = await conn.channel(publisher_confirms=True, on_return_raises=True)
            exchange = await channel.declare_exchange(self.exchange_name, aio_pika.ExchangeType.TOPIC, durable=True)
        except BaseException as exc:
            # An exchange RabbitMQ will not declare (another type of that name, ...) fails every batch: the
            # connection opened for it is closed, not left open once per batch.
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
            if isinstance(exc, _CREDENTIALS_REFUSED):  # an AMQPConnectionError, but the URL's, not the network's
                raise BrokerMisconfigured(f"{self.name}: RabbitMQ refuses the broker URL's credentials: "
                                          f"{type(exc).__name__}: {exc}") from exc
            if isinstance(exc, (*_UNREACHABLE, TimeoutError)):
                raise BrokerUnavailable(f"{self.name}: {type(exc).__name__}: {exc}") from exc
            if isinstance(exc, _REFUSED_SETUP):  # the configuration's: the relay holds the events
                raise BrokerMisconfigured(f"{self.name}: RabbitMQ will not declare exchange {self.exchange_name!r}: "
                                          f"{exc}") from exc
            raise
        if conn.transport is not None:
            _FORCED_CLOSES.watch(conn.transport.connection, self.name)
        self._conn, self._channel, self._exchange = conn, channel, exchange
        return exchange

    async def _drop(self) -> None:
        conn, self._conn, self._channel, self._exchange = self._conn, None, None, None
        if conn is not None and not conn.is_closed:
            try:
                await conn.close()
            except Exception:  # noqa: BLE001 - closing a broken connection may fail in many ways
                return

    async def publish(self, batch: Sequence[StagedEvent]) -> list[PublishResult]:
        exchange = await self._connect()

        async def send(event: StagedEvent) -> PublishResult:  # noqa: PLR0911 - one return per broker answer
            if self._exchange is not exchange:  # the connection stopped answering during this batch
                return PublishResult.transient(f"{self.name}: not sent, the connection stopped answering",
                                               attempted=False)
            routing_key = self.routing.target(event)
            if len(routing_key.encode()) > MAX_SHORT_STRING_BYTES:  # the client cannot send it
                return PublishResult.refused(f"routing key of {len(routing_key.encode())} bytes exceeds AMQP's "
                                             f"{MAX_SHORT_STRING_BYTES}: {routing_key[:60]!r}...")
            headers: dict[str, Any] = dict(headers_of(event))
            short = len(event.type.encode()) <= MAX_SHORT_STRING_BYTES  # else in the headers and envelope only
            message = aio_pika.Message(
                body_of(event), headers=headers, message_id=event.event_id, type=event.type if short else None,
                content_type="application/json", delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
            try:
                await exchange.publish(message, routing_key=routing_key, mandatory=True,
                                       timeout=self.timeout)
            except aiormq.exceptions.PublishError as exc:
                return PublishResult.refused(f"returned unroutable: {exc}")
            except aiormq.exceptions.DeliveryError as exc:
                return PublishResult.transient(f"nacked: {exc}")
            except TimeoutError:
                if not await self._answers(exchange):
                    return PublishResult.transient(f"{self.name}: no publisher confirm, and no answer on the "
                                                   f"connection within {PROBE_SECONDS:g} s", attempted=False)
                return PublishResult.transient("no publisher confirm within the timeout")
            except _UNREACHABLE as exc:
                return PublishResult.transient(f"{self.name}: {type(exc).__name__}", attempted=False)
            return PublishResult.OK

        results = await publish_in_lanes(batch, send, concurrency=self.concurrency)
        if self._channel is None or self._channel.is_closed or self._exchange is not exchange:
            await self._drop()
        return results

    async def _answers(self, exchange: AbstractExchange) -> bool:
        """Whether the broker still answers on this channel (a passive declaration of the exchange), asked
        when a confirm did not come. A connection that forwards nothing (a partition, a hung node) is the
        broker unreachable: no attempt is counted, and the connection is dropped for the next batch."""
        channel = self._channel
        if channel is None or self._exchange is not exchange:
            return False
        try:
            async with asyncio.timeout(PROBE_SECONDS):
                await channel.declare_exchange(self.exchange_name, passive=True)
        except (*_UNREACHABLE, TimeoutError):
            if self._exchange is exchange:
                self._exchange = None  # publish() drops the connection once the batch is done
            return False
        except aiormq.exceptions.AMQPError:  # an answer, whatever it says
            return True
        return True

    async def close(self) -> None:
        await self._drop()


def amqp_publisher(url: str, **options: Any) -> RabbitMqPublisher:
    """Entry point for ``amqp://`` and ``amqps://``; the publisher's own query parameters are removed
    from the URL the client connects with. They are checked here (ValueError), not at the first publish;
    an option neither this publisher nor the client reads is refused."""
    parts = urlsplit(url)
    ours = query_options(url, _OURS, client=_CLIENTS)
    rest = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k not in _OURS])
    connect_url = urlunsplit((parts.scheme, parts.netloc, parts.path or "/", rest, parts.fragment))
    template = options.get("routing") or ours.get("routing_key") or DEFAULT_ROUTING_KEY
    return RabbitMqPublisher(connect_url, exchange=ours.get("exchange", DEFAULT_EXCHANGE), routing=Routing(template),
                             concurrency=whole_option(ours, "concurrency", 64, 1, MAX_CONCURRENCY))
