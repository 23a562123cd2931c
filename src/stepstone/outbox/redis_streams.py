"""Redis Streams publisher (extra ``stepstone[redis]``): one XADD per event, trimmed by MAXLEN.

    redis://[:password@]host:6379[/db]?stream=stepstone:{category}&maxlen=1000000&concurrency=32

Each entry has the fields ``event_id`` (the consumer's dedup id: Redis 7 has no server-side
deduplication of XADD), ``type``, ``key`` (empty when none) and ``body`` (the JSON envelope, with
the trace context). ``maxlen`` trims approximately (``MAXLEN ~``); 0 keeps everything. An XADD is
acknowledged when Redis answers it, so durability is whatever the server's persistence gives.

A reply about the server's state rather than the event (OOM: maxmemory reached; READONLY: a replica;
BUSY, LOADING, MISCONF, MASTERDOWN, CLUSTERDOWN, TRYAGAIN) counts no attempt, as an unreachable Redis;
an ACL refusal (NOPERM, of the XADD or the PING) is the broker URL's user, and a refusal of its credentials
(WRONGPASS, NOAUTH) the URL's: either is held as a misconfiguration.
Other command errors (WRONGTYPE, ...) refuse the event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from stepstone.errors import BrokerMisconfigured, BrokerUnavailable
from stepstone.outbox.publisher import (
    MAX_CONCURRENCY,
    PublishResult,
    Routing,
    body_of,
    publish_in_lanes,
    query_options,
    whole_option,
)
from stepstone.store.database import redact_url
from stepstone.store.outbox import StagedEvent

__all__ = ["RedisStreamsPublisher", "redis_publisher"]

DEFAULT_STREAM = "stepstone:{category}"
DEFAULT_MAXLEN = 1_000_000
PROBE_SECONDS = 2.0
"""How long the PING before each batch waits for Redis: the client's own socket timeout, retried, outlived
half the relay's lease on a connection that no longer forwarded anything, and the batch counted attempts."""
_STATE_REPLIES: dict[type[redis_errors.ResponseError], str] = {
    redis_errors.OutOfMemoryError: "OOM", redis_errors.ReadOnlyError: "READONLY",
    redis_errors.MasterDownError: "MASTERDOWN", redis_errors.ClusterDownError: "CLUSTERDOWN",
    redis_errors.TryAgainError: "TRYAGAIN",
}
"""Replies about the server's state that redis-py turns into a class of its own, their code stripped from the
text (so a check of the text for "OOM" never matched: a full Redis refused every event for good)."""
_STATE_CODES = ("BUSY", "LOADING", "MISCONF")
"""The same, for replies redis-py leaves a plain ResponseError with the code in its text."""
_NOT_ALLOWED = (redis_errors.AuthenticationError, redis_errors.NoPermissionError)
"""The broker URL's credentials refused (WRONGPASS, NOAUTH) or its user not allowed a command by the ACL
(NOPERM): the configuration's, whatever the events, so held as a misconfiguration."""


class RedisStreamsPublisher:
    def __init__(self, url: str, *, routing: Routing | None = None, maxlen: int = DEFAULT_MAXLEN,
                 concurrency: int = 32) -> None:
        self.name = redact_url(url.split("?", 1)[0])
        self.routing = routing or Routing(DEFAULT_STREAM)
        self.maxlen = maxlen
        self.concurrency = concurrency
        self.client: aioredis.Redis = aioredis.Redis.from_url(
            url.split("?", 1)[0], max_connections=concurrency, socket_connect_timeout=2.0, socket_timeout=10.0)

    @staticmethod
    def fields(event: StagedEvent) -> dict[str, str]:
        return {"event_id": event.event_id, "type": event.type, "key": event.key or "",
                "body": body_of(event).decode()}

    async def publish(self, batch: Sequence[StagedEvent]) -> list[PublishResult]:
        try:
            async with asyncio.timeout(PROBE_SECONDS):
                await self.client.ping()
        except TimeoutError as exc:  # redis-py's own TimeoutError is no subclass of it
            raise BrokerUnavailable(f"{self.name}: no answer to PING within {PROBE_SECONDS:g} s") from exc
        except _NOT_ALLOWED as exc:  # before ConnectionError: AuthenticationError is one, but the URL's
            raise BrokerMisconfigured(_not_allowed(self.name, exc)) from exc
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
            raise BrokerUnavailable(f"{self.name}: {exc}") from exc

        async def send(event: StagedEvent) -> PublishResult:
            try:
                await self.client.xadd(self.routing.target(event), self.fields(event),  # type: ignore[arg-type]
                                       maxlen=self.maxlen or None, approximate=True)
            except _NOT_ALLOWED as exc:  # a new connection of the pool refused, or the XADD by the ACL
                return PublishResult.held(_not_allowed(self.name, exc))
            except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
                return PublishResult.transient(f"{self.name}: {exc}", attempted=False)
            except redis_errors.DataError as exc:  # the client's own check of the command: for good
                return PublishResult.refused(str(exc))
            except redis_errors.ResponseError as exc:
                state = _server_state(exc)
                if state is not None:  # the server's, whatever the event: nothing counted, as unreachable
                    return PublishResult.transient(f"{self.name}: {state}", attempted=False)
                return PublishResult.refused(str(exc))
            return PublishResult.OK

        return await publish_in_lanes(batch, send, concurrency=self.concurrency)

    async def read(self, stream: str) -> list[tuple[str, dict[str, Any]]]:
        """Every entry of `stream` as (entry id, envelope), oldest first: reading the broker back."""
        entries: list[tuple[bytes, dict[bytes, bytes]]] = await self.client.xrange(stream)  # type: ignore[assignment]
        return [(entry_id.decode(), decode_entry(fields)) for entry_id, fields in entries]

    async def close(self) -> None:
        await self.client.aclose()


def redis_publisher(url: str, **options: Any) -> RedisStreamsPublisher:
    """Entry point for ``redis://`` and ``rediss://``; its options are checked here (ValueError), not
    at the first XADD. The client connects without the query, so it takes no option of its own."""
    query = query_options(url, ("stream", "maxlen", "concurrency"))
    template = options.get("routing") or query.get("stream") or DEFAULT_STREAM
    return RedisStreamsPublisher(
        url, routing=Routing(template), maxlen=whole_option(query, "maxlen", DEFAULT_MAXLEN, 0),
        concurrency=whole_option(query, "concurrency", 32, 1, MAX_CONCURRENCY))


def _server_state(exc: redis_errors.ResponseError) -> str | None:
    """The reply with its code when it is about the server's state (`_STATE_REPLIES`), else None."""
    text = str(exc)
    code = next((code for kind, code in _STATE_REPLIES.items() if isinstance(exc, kind)), None)
    if code is not None:
        return f"{code} {text}"
    return text if text.startswith(_STATE_CODES) else None


def _not_allowed(name: str, exc: redis_errors.RedisError) -> str:
    if isinstance(exc, redis_errors.AuthenticationError):
        return f"{name}: Redis refuses the broker URL's credentials (WRONGPASS or NOAUTH): {exc}"
    return f"{name}: NOPERM {exc}: allow the broker URL's user that command in Redis's ACL"


def decode_entry(fields: dict[Any, Any]) -> dict[str, Any]:
    """A stream entry as a consumer reads it back: the envelope, from the ``body`` field."""
    text = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in fields.items()}
    body: dict[str, Any] = json.loads(text["body"])
    return body
