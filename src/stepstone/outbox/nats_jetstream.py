"""NATS JetStream publisher (extra ``stepstone[nats]``): an acknowledged publish per event.

    nats://host:4222?subject=stepstone.{type}&stream=STEPSTONE&concurrency=64

Every message carries the header ``Nats-Msg-Id: <event id>``, so JetStream drops a republished
event inside the stream's duplicate window (2 minutes by default) and acknowledges it as a
duplicate. An event counts as published when JetStream's PubAck arrives (the stream stored it).
With ``stream=NAME`` the publisher creates that stream, capturing the subject template's fixed
prefix (``stepstone.>``), when it does not exist; otherwise a stream must already capture the
subjects, and an event no stream captures is refused (dead-lettered until requeued).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from nats import errors as nats_errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js import errors as js_errors

from stepstone.errors import BrokerMisconfigured, BrokerUnavailable
from stepstone.outbox.publisher import (
    MAX_CONCURRENCY,
    PublishResult,
    Routing,
    body_of,
    publish_in_lanes,
    query_options,
    text_headers_of,
    whole_option,
)
from stepstone.store.database import redact_url
from stepstone.store.outbox import StagedEvent

__all__ = ["NatsJetStreamPublisher", "nats_publisher", "stream_subjects"]

DEFAULT_SUBJECT = "stepstone.{type}"
PROBE_SECONDS = 2
"""How long a PING waits for its PONG when a PubAck did not come: no PONG is the broker unreachable."""
_STREAM_NAME = re.compile(r"[^\s.*>/\\]+")  # JetStream: no whitespace, '.', '*', '>' or path separator
_UNREACHABLE = (nats_errors.ConnectionClosedError, nats_errors.ConnectionReconnectingError,
                nats_errors.ConnectionDrainingError, nats_errors.NoServersError, nats_errors.StaleConnectionError,
                nats_errors.OutboundBufferLimitError, OSError)
_CREDENTIALS_REFUSED = "authorization violation"
"""The server's -ERR to a CONNECT with credentials it does not accept (or none where it wants some), which
nats-py raises as a plain `nats.errors.Error`: counted against each event, it dead-lettered the outbox."""


async def connect(url: str, **options: Any) -> NatsClient:
    """`nats.connect`, except that a client whose CONNECT the server refused is closed (nats.connect left its
    socket open, once per batch while the relay held the events)."""
    nc = NatsClient()
    try:
        await nc.connect(url, **options)
    except BaseException:
        await nc.close()
        raise
    return nc


async def _ignore(_error: Exception) -> None:
    """Connection errors surface as BrokerUnavailable or per-event results; the client's own log is noise."""


def stream_subjects(template: str) -> list[str]:
    """The subjects a stream needs to capture everything the template routes: its fixed prefix + ``>``."""
    prefix = template.split("{", 1)[0]
    if prefix == template:
        return [template]
    head = prefix.rsplit(".", 1)[0] if "." in prefix else ""
    return [f"{head}.>" if head else ">"]


class NatsJetStreamPublisher:
    def __init__(self, url: str, *, routing: Routing | None = None, stream: str | None = None,
                 concurrency: int = 64, timeout: float = 5.0) -> None:
        self.url = url.split("?", 1)[0]
        self.name = redact_url(self.url)
        self.routing = routing or Routing(DEFAULT_SUBJECT)
        self.stream = stream
        self.concurrency = concurrency
        self.timeout = timeout
        self._nc: NatsClient | None = None
        self._js: JetStreamContext | None = None
        self._jetstream: Exception | bool | None = None
        """Of this connection: unknown (None), JetStream answers (False), or why it does not (an error)."""

    async def _connect(self) -> JetStreamContext:
        if self._js is not None and self._nc is not None and self._nc.is_connected:
            return self._js
        await self._drop()
        try:
            # One try per server (0 would mean for ever); the relay backs off and reconnects itself.
            nc = await connect(self.url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=1,
                               reconnect_time_wait=0.1, error_cb=_ignore)
        except (*_UNREACHABLE, nats_errors.TimeoutError, TimeoutError) as exc:
            raise BrokerUnavailable(f"{self.name}: {type(exc).__name__}: {exc}") from exc
        except nats_errors.Error as exc:
            if _CREDENTIALS_REFUSED in str(exc).lower():  # the URL's, whatever the events: the relay holds them
                raise BrokerMisconfigured(f"{self.name}: the server refuses the broker URL's credentials: {exc}") \
                    from exc
            raise
        js = nc.jetstream(timeout=self.timeout)
        try:
            if self.stream:
                try:
                    await js.stream_info(self.stream)
                except js_errors.NotFoundError:
                    await js.add_stream(name=self.stream, subjects=stream_subjects(self.routing.template))
        except BaseException as exc:
            # A stream JetStream will not create (its subjects overlap another's, ...) fails every batch: the
            # connection opened for it is closed, not left open once per batch, and the refusal is the
            # configuration's (the relay holds the events), not the events'.
            await nc.close()
            if isinstance(exc, js_errors.ServiceUnavailableError):
                raise self._no_jetstream(exc) from exc
            if isinstance(exc, js_errors.APIError):
                raise BrokerMisconfigured(f"{self.name}: JetStream will not create stream {self.stream!r} for "
                                          f"{stream_subjects(self.routing.template)}: {exc}") from exc
            raise
        self._nc, self._js, self._jetstream = nc, js, None
        return js

    def _no_jetstream(self, exc: Exception) -> BrokerMisconfigured:
        return BrokerMisconfigured(f"{self.name}: JetStream does not answer (is it enabled on this server, for "
                                   f"this account?): {exc}")

    async def _jetstream_answers(self, js: JetStreamContext) -> bool:
        """Asked once a connection when a publish found no responder: whether JetStream itself answers (its
        account info). No responder there either is a server without JetStream, the configuration's mistake
        (the relay holds the batch), not an event no stream captures (refused). Any other answer, or none (a
        user not allowed to ask), keeps the refusal."""
        if self._jetstream is None:
            try:
                await js.account_info()
            except js_errors.ServiceUnavailableError as exc:
                self._jetstream = exc
            except Exception:  # noqa: BLE001 - see above: the publish's own refusal stands
                self._jetstream = False
            else:
                self._jetstream = False
        return self._jetstream is False

    async def _drop(self) -> None:
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None and not nc.is_closed:
            try:
                await nc.close()
            except Exception:  # noqa: BLE001 - closing a broken connection may fail in many ways
                return

    async def publish(self, batch: Sequence[StagedEvent]) -> list[PublishResult]:
        js = await self._connect()

        async def send(event: StagedEvent) -> PublishResult:  # noqa: PLR0911 - one return per broker answer
            if self._js is not js:  # the connection stopped answering during this batch
                return PublishResult.transient(f"{self.name}: not sent, the connection stopped answering",
                                               attempted=False)
            headers = {"Nats-Msg-Id": event.event_id, **text_headers_of(event)}
            try:
                await js.publish(self.routing.target(event), body_of(event), timeout=self.timeout, headers=headers)
            except nats_errors.BadSubjectError:  # the client's own check: never sent, and never will be
                return PublishResult.refused(f"{self.routing.target(event)!r} is no NATS subject (no whitespace)")
            except (nats_errors.NoRespondersError, js_errors.NoStreamResponseError):
                if not await self._jetstream_answers(js):
                    return PublishResult.transient(f"{self.name}: JetStream does not answer", attempted=False)
                return PublishResult.refused(f"no JetStream stream captures subject {self.routing.target(event)!r}")
            except nats_errors.MaxPayloadError as exc:
                return PublishResult.refused(f"message too large: {exc}")
            except js_errors.ServiceUnavailableError as exc:
                return PublishResult.transient(f"JetStream unavailable: {exc}")
            except js_errors.APIError as exc:
                return PublishResult.refused(f"JetStream refused it: {exc}")
            except (nats_errors.TimeoutError, TimeoutError):
                if not await self._answers(js):
                    return PublishResult.transient(f"{self.name}: no PubAck, and no answer to a PING within "
                                                   f"{PROBE_SECONDS:g} s", attempted=False)
                return PublishResult.transient("no PubAck within the timeout")
            except _UNREACHABLE as exc:
                return PublishResult.transient(f"{self.name}: {type(exc).__name__}", attempted=False)
            return PublishResult.OK

        results = await publish_in_lanes(batch, send, concurrency=self.concurrency)
        missing = self._jetstream
        if self._nc is None or not self._nc.is_connected or self._js is not js or isinstance(missing, Exception):
            await self._drop()  # reconnect on the next batch
        if isinstance(missing, Exception):
            raise self._no_jetstream(missing)
        return results

    async def _answers(self, js: JetStreamContext) -> bool:
        """Whether the server still answers on this connection (a PING's PONG), asked when a PubAck did not
        come. A connection that forwards nothing (a partition, a hung server) is the broker unreachable: no
        attempt is counted, and the connection is dropped so the next batch connects again."""
        nc = self._nc
        if nc is None or self._js is not js:
            return False
        try:
            await nc.flush(timeout=PROBE_SECONDS)
        except (*_UNREACHABLE, nats_errors.TimeoutError, TimeoutError):
            if self._js is js:
                self._js = None  # publish() drops it once the batch is done
            return False
        return True

    async def close(self) -> None:
        await self._drop()


def nats_publisher(url: str, **options: Any) -> NatsJetStreamPublisher:
    """Entry point for ``nats://``; its options are checked here (ValueError), not at the first publish.
    The client connects without the query, so it takes no option of its own."""
    query = query_options(url, ("subject", "stream", "concurrency"))
    template = options.get("routing") or query.get("subject") or DEFAULT_SUBJECT
    stream = query.get("stream")
    if stream is not None and not (stream.isprintable() and _STREAM_NAME.fullmatch(stream)):
        raise ValueError(f"stream {stream!r} is no JetStream stream name (no whitespace, '.', '*', '>', '/' or '\\')")
    return NatsJetStreamPublisher(url, routing=Routing(template), stream=stream,
                                  concurrency=whole_option(query, "concurrency", 64, 1, MAX_CONCURRENCY))
