"""The publisher port: how the relay hands a batch of events to a broker, and the in-memory broker.

    publish(batch) -> one PublishResult per event, in batch order:
        ok          the broker acknowledged the event (it is durable there)
        transient   not acknowledged, try again later (counted towards max attempts when attempted)
        refused     the broker refused this event for good (unroutable, too large, wrong type, 4xx)
        held        not acknowledged for a reason of the configuration, not of the event (a webhook's 401):
                    no attempt counted, and the relay holds the outbox as for BrokerMisconfigured
    A broker that cannot be reached at all raises BrokerUnavailable: nothing was acknowledged and no
    attempt is counted; one that refuses the publisher's setup raises BrokerMisconfigured.

Contract every publisher keeps (the conformance suite holds each one to it): events of one key are
sent in batch order, each only after the previous one of its key was acknowledged, and after an
event of a key is not acknowledged no later event of that key in the batch is sent. Events with no
key, and different keys, may go in parallel. `publish_in_lanes` implements exactly that.

Brokers are found by URL scheme through the `stepstone.publishers` entry points, so the core never
imports a broker client; each adapter is an optional extra.
"""

from __future__ import annotations

import asyncio
import enum
import json
import re
import string
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, ClassVar, Protocol
from urllib.parse import parse_qsl, quote, urlsplit

from stepstone.core.limits import MAX_INT8
from stepstone.errors import BrokerUnavailable, ConfigError, UnknownBroker
from stepstone.store.database import redact_url
from stepstone.store.outbox import StagedEvent

__all__ = [
    "ENTRY_POINT_GROUP",
    "InMemoryBroker",
    "InMemoryPublisher",
    "Message",
    "Outcome",
    "PublishResult",
    "Publisher",
    "Routing",
    "envelope",
    "headers_of",
    "open_publisher",
    "publish_in_lanes",
    "publish_progress",
    "query_options",
    "text_headers_of",
    "whole_option",
]

ENTRY_POINT_GROUP = "stepstone.publishers"
MAX_CONCURRENCY = 10_000
"""Events one publisher sends at once at most (its `concurrency` option)."""
EXTRAS = {"redis": "redis", "nats": "nats", "amqp": "rabbitmq", "amqps": "rabbitmq", "http": "webhook",
          "https": "webhook"}


class Outcome(enum.Enum):
    OK = "ok"
    TRANSIENT = "transient"
    REFUSED = "refused"


@dataclass(frozen=True)
class PublishResult:
    outcome: Outcome
    error: str | None = None
    attempted: bool = True
    """False when the event was never offered to a reachable broker: no attempt is counted."""
    misconfigured: bool = False
    """The answer says the configuration is wrong for every event, whatever this one is (see `held`)."""

    OK: ClassVar[PublishResult]

    @classmethod
    def transient(cls, error: str, *, attempted: bool = True) -> PublishResult:
        return cls(Outcome.TRANSIENT, error, attempted)

    @classmethod
    def refused(cls, error: str) -> PublishResult:
        return cls(Outcome.REFUSED, error)

    @classmethod
    def held(cls, error: str) -> PublishResult:
        """Not acknowledged because the configuration is wrong for any event (a webhook answered 401, a
        Redis ACL refuses the command): no attempt counted, and the relay holds the outbox, raising
        BrokerMisconfigured after recording what the broker did acknowledge beside it."""
        return cls(Outcome.TRANSIENT, error, attempted=False, misconfigured=True)


PublishResult.OK = PublishResult(Outcome.OK)


class Publisher(Protocol):
    """A broker adapter. `name` is the redacted broker URL, for messages."""

    name: str

    async def publish(self, batch: Sequence[StagedEvent]) -> list[PublishResult]: ...
    async def close(self) -> None: ...


@dataclass(frozen=True)
class Routing:
    """Where an event goes (stream, subject, routing key), from a template over the event.

    Fields: ``{type}`` (e.g. ``order.shipped``), ``{category}`` (the type up to its first dot, ``order``)
    and ``{key}`` (the partition key, empty when none). With `url_quoted` (a webhook URL) each value is
    percent-encoded, so a key such as ``../admin`` or ``a#b`` stays one path segment of the template.
    """

    template: str
    url_quoted: bool = False
    FIELDS: ClassVar[frozenset[str]] = frozenset({"type", "category", "key"})

    def __post_init__(self) -> None:
        try:
            names = {name for _, name, _, _ in string.Formatter().parse(self.template) if name is not None}
        except ValueError as exc:
            raise ConfigError(f"routing template {self.template!r}: {exc}") from exc
        unknown = names - self.FIELDS
        if unknown:
            raise ConfigError(f"routing template {self.template!r} uses unknown field(s) {sorted(unknown)}; "
                              f"use {{type}}, {{category}} or {{key}}")

    @property
    def fixed(self) -> bool:
        """Whether every event goes to the same target (the template uses no field)."""
        return all(name is None for _, name, _, _ in string.Formatter().parse(self.template))

    def target(self, event: StagedEvent) -> str:
        return self.target_of(event.type, event.key)

    def target_of(self, event_type: str, key: str | None) -> str:
        """Where an event of `event_type` and `key` goes (what `target` says of a staged one)."""
        fields = {"type": event_type, "category": event_type.partition(".")[0], "key": key or ""}
        if self.url_quoted:
            fields = {name: quote(value, safe="") for name, value in fields.items()}
        return self.template.format(**fields)


def envelope(event: StagedEvent) -> dict[str, Any]:
    """The message body every broker carries: the event id (the consumer's dedup id) and trace context."""
    return {
        "id": event.event_id,
        "type": event.type,
        "key": event.key,
        "instance_id": event.instance_id,
        "occurred_at": event.created_at.isoformat(),
        "payload": event.payload,
        "trace_context": event.trace_context,
    }


def body_of(event: StagedEvent) -> bytes:
    return json.dumps(envelope(event), separators=(",", ":"), ensure_ascii=False).encode()


def headers_of(event: StagedEvent) -> dict[str, str]:
    """Broker-native headers: the event id, type, key and W3C trace context when the event has one."""
    headers = {"stepstone-event-id": event.event_id, "stepstone-event-type": event.type,
               "stepstone-instance-id": event.instance_id}
    if event.key is not None:
        headers["stepstone-key"] = event.key
    for name in ("traceparent", "tracestate"):
        value = (event.trace_context or {}).get(name)
        if isinstance(value, str):
            headers[name] = value
    return headers


_TEXT_HEADER_VALUE = re.compile(r"([\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?)?")


def text_headers_of(event: StagedEvent) -> dict[str, str]:
    """`headers_of`, for brokers whose headers are lines of text (HTTP, NATS): a value they carry as it is
    (visible ASCII, spaces inside only), others left out; the envelope has them. A key such as `café`, with a
    line break or spaces around it, was refused by the HTTP client on every POST, and NATS's client trimmed
    it or made its line break a space: a consumer reading the header got a key no event has."""
    return {name: value for name, value in headers_of(event).items() if _TEXT_HEADER_VALUE.fullmatch(value)}


def query_options(url: str, ours: Collection[str], *, client: Collection[str] = ()) -> dict[str, str]:
    """The publisher's own options (`ours`) from a broker URL's query, each with a value. An option that
    neither the publisher nor its client (`client`) reads is refused: it used to be ignored silently.
    Raises ValueError, which `open_publisher` reports as a malformed URL."""
    options: dict[str, str] = {}
    for name, value in parse_qsl(urlsplit(url).query, keep_blank_values=True):
        if name in ours:
            if not value:
                raise ValueError(f"{name} must not be empty")
            options[name] = value
        elif name not in client:
            raise ValueError(f"unknown option {name!r}; it takes {', '.join([*ours, *sorted(client)])}")
    return options


def whole_option(options: dict[str, str], name: str, default: int, low: int, high: int = MAX_INT8) -> int:
    """Option `name` as a whole number from `low` to `high` (`default` when absent); else ValueError."""
    text = options.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise ValueError(f"{name} must be a whole number from {low:,} to {high:,}, got {text!r}")
    return value


Send = Callable[[StagedEvent], Awaitable[PublishResult]]

_PROGRESS: ContextVar[dict[int, PublishResult | None] | None] = ContextVar("stepstone_publish_progress", default=None)


@contextmanager
def publish_progress() -> Iterator[dict[int, PublishResult | None]]:
    """What `publish_in_lanes` has done so far within this block, by outbox id: None once an event's send
    began, its result once the broker answered. A publish cut short (the relay's bound of half the lease)
    still tells which events the broker acknowledged and which it was never offered."""
    progress: dict[int, PublishResult | None] = {}
    token = _PROGRESS.set(progress)
    try:
        yield progress
    finally:
        _PROGRESS.reset(token)


async def publish_in_lanes(batch: Sequence[StagedEvent], send: Send, *, concurrency: int = 64) -> list[PublishResult]:
    """Send each key's events one after another, keys (and unkeyed events) in parallel, and stop a key at
    its first event not acknowledged: its later events come back transient and not attempted."""
    results: list[PublishResult | None] = [None] * len(batch)
    lanes: dict[object, list[int]] = {}
    for i, event in enumerate(batch):
        lanes.setdefault(event.key if event.key is not None else ("", i), []).append(i)
    gate = asyncio.Semaphore(concurrency)
    progress = _PROGRESS.get()
    if progress is None:
        progress = {}

    async def run(lane: list[int]) -> None:
        async with gate:
            for pos, i in enumerate(lane):
                progress[batch[i].id] = None
                try:
                    result = await send(batch[i])
                except Exception as exc:  # noqa: BLE001 - the event's failure, counted; other lanes go on
                    result = PublishResult.transient(f"{type(exc).__name__}: {exc}")
                results[i] = progress[batch[i].id] = result
                if result.outcome is not Outcome.OK:
                    skipped = PublishResult.transient(
                        f"not sent: event {batch[i].event_id} of the same key was not acknowledged", attempted=False)
                    for j in lane[pos + 1:]:
                        results[j] = skipped
                    return

    await asyncio.gather(*(run(lane) for lane in lanes.values()))
    return [r if r is not None else PublishResult.transient("not sent", attempted=False) for r in results]


def open_publisher(url: str, **options: Any) -> Publisher:
    """The publisher registered for the URL's scheme (`stepstone.publishers` entry points)."""
    scheme = _checked(url)
    found = entry_points(group=ENTRY_POINT_GROUP, name=scheme)
    if not found:
        known = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
        raise UnknownBroker(f"no publisher for broker URL {redact_url(url)!r}: known schemes {', '.join(known)}")
    entry = next(iter(found))
    try:
        factory = entry.load()
    except ImportError as exc:
        extra = EXTRAS.get(scheme, scheme)
        raise UnknownBroker(f"the {scheme}:// publisher needs its client library ({exc.name}): "
                            f"pip install 'stepstone[{extra}]'") from exc
    try:
        publisher: Publisher = factory(url, **options)
    except ValueError as exc:  # the publisher's own reading of the URL (a query value that is no number, ...)
        raise _malformed(url, str(exc)) from None
    return publisher


def _checked(url: str) -> str:
    """The URL's scheme, once its host and port are ones a client can connect to: a bad port or bracket
    was each client's ValueError (a traceback from `stepstone worker --broker`); with no host at all some
    clients failed only when the relay first published, and one fell back to a default host."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - read for its check: a port that is no number, or out of range
    except ValueError as exc:
        raise _malformed(url, str(exc)) from None
    scheme = parts.scheme.lower()
    if scheme != "memory" and not parts.hostname:
        raise _malformed(url, "it names no host")
    return scheme


def _malformed(url: str, reason: str) -> ConfigError:
    return ConfigError(f"broker URL {redact_url(url)!r} is malformed: {reason}")


# -- the in-memory broker ------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """What a broker holds: the event id, the target it was routed to, the body and headers."""

    event_id: str
    type: str
    key: str | None
    target: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class InMemoryBroker:
    """A broker in this process, shared by every `memory://NAME` publisher of the same name.

    Faults for tests: `down` makes publishes raise BrokerUnavailable; `refuse(event)` returning a
    reason refuses that event for good; `accept_only(n)` acknowledges the next n events and then
    answers transient failures until `accept_only(None)`.
    """

    name: str = "default"
    messages: list[Message] = field(default_factory=list)
    down: bool = False
    refuse: Callable[[StagedEvent], str | None] | None = None
    _budget: int | None = None
    _changed: asyncio.Event | None = field(default=None, repr=False)
    _named: ClassVar[dict[str, InMemoryBroker]] = {}

    @classmethod
    def named(cls, name: str) -> InMemoryBroker:
        broker = cls._named.get(name)
        if broker is None:
            broker = cls._named[name] = cls(name)
        return broker

    @classmethod
    def forget(cls, name: str) -> None:
        cls._named.pop(name, None)

    def accept_only(self, count: int | None) -> None:
        self._budget = count

    def offer(self, event: StagedEvent, target: str) -> PublishResult:
        if self.down:
            return PublishResult.transient(f"memory broker {self.name!r} is down", attempted=False)
        reason = self.refuse(event) if self.refuse is not None else None
        if reason is not None:
            return PublishResult.refused(reason)
        if self._budget is not None:
            if self._budget <= 0:
                return PublishResult.transient("memory broker: no acknowledgement (injected)")
            self._budget -= 1
        self.messages.append(Message(event.event_id, event.type, event.key, target, envelope(event),
                                     headers_of(event)))
        if self._changed is not None:
            self._changed.set()
        return PublishResult.OK

    async def wait_for(self, predicate: Callable[[list[Message]], bool], timeout: float = 30.0) -> None:
        """Wait until `predicate(messages)` holds (tests wait on this, never on a sleep)."""
        async with asyncio.timeout(timeout):
            while not predicate(self.messages):
                self._changed = self._changed or asyncio.Event()
                self._changed.clear()
                await self._changed.wait()


class InMemoryPublisher:
    """Publishes into an `InMemoryBroker`; `memory://NAME?target=TEMPLATE` (default name `default`)."""

    def __init__(self, broker: InMemoryBroker, routing: Routing | None = None) -> None:
        self.broker = broker
        self.routing = routing or Routing("{type}")
        self.name = f"memory://{broker.name}"

    async def publish(self, batch: Sequence[StagedEvent]) -> list[PublishResult]:
        if self.broker.down:
            raise BrokerUnavailable(f"memory broker {self.broker.name!r} is down")

        async def send(event: StagedEvent) -> PublishResult:
            await asyncio.sleep(0)  # lanes interleave, as they do against a real broker
            return self.broker.offer(event, self.routing.target(event))

        return await publish_in_lanes(batch, send)

    async def close(self) -> None:
        return None


def memory_publisher(url: str, **options: Any) -> InMemoryPublisher:
    """Entry point for ``memory://NAME``."""
    parts = urlsplit(url)
    name = (parts.netloc + parts.path).strip("/") or "default"
    query = query_options(url, ("target",))
    template = options.get("routing") or query.get("target") or "{type}"
    return InMemoryPublisher(InMemoryBroker.named(name), Routing(template))
