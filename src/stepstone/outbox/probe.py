"""Whether a broker answers, for `stepstone doctor`: a short look at the server, never a publish.

Redis is asked PING, NATS is expected to greet with INFO, RabbitMQ to answer the AMQP 0-9-1 protocol
header with its Connection.Start frame; TLS schemes (rediss, amqps, https) and webhooks are only
connected to. The probe imports no broker client: it works whether or not the extra is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from stepstone.store.database import redact_url

__all__ = ["BrokerProbe", "probe_broker"]

_PORTS = {"redis": 6379, "rediss": 6379, "nats": 4222, "amqp": 5672, "amqps": 5671, "http": 80, "https": 443}
_AMQP_HEADER = b"AMQP\x00\x00\x09\x01"
_AMQP_METHOD_FRAME = 1


@dataclass(frozen=True)
class BrokerProbe:
    url: str
    """Redacted: no password."""
    answers: bool | None
    """None when there is nothing to reach (an in-process broker)."""
    detail: str


async def probe_broker(url: str, timeout: float = 2.0) -> BrokerProbe:
    """Connect to the broker of `url` and check that it speaks its protocol, within `timeout` seconds."""
    shown = redact_url(url)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "memory":
        return BrokerProbe(shown, None, "in-process broker (memory://): nothing to reach")
    try:
        host, port = parts.hostname or "localhost", parts.port or _PORTS[scheme]
    except (KeyError, ValueError):
        return BrokerProbe(shown, False, f"cannot tell where a {scheme}:// broker listens")
    where = f"{host}:{port}"
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                detail = await _GREETINGS.get(scheme, _connected)(reader, writer)
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except TimeoutError:
        return BrokerProbe(shown, False, f"{where}: no answer within {timeout:g} s")
    except OSError as exc:
        return BrokerProbe(shown, False, f"{where}: {exc.strerror or exc}")
    if detail.startswith("!"):
        return BrokerProbe(shown, False, f"{where}: {detail[1:]}")
    return BrokerProbe(shown, True, f"{where}: {detail}")


async def _redis(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
    writer.write(b"PING\r\n")
    await writer.drain()
    line = await reader.readline()
    if line.startswith(b"+PONG"):
        return "redis answered PING"
    if line.startswith((b"-NOAUTH", b"-WRONGPASS")):
        return "redis answers (it wants credentials to PING)"
    return f"!not a redis answer to PING: {line[:40]!r}"


async def _nats(reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> str:
    line = await reader.readline()
    return "nats greeted with INFO" if line.startswith(b"INFO") else f"!not a nats greeting: {line[:40]!r}"


async def _amqp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
    writer.write(_AMQP_HEADER)
    await writer.drain()
    frame = await reader.read(7)
    if frame[:1] == bytes([_AMQP_METHOD_FRAME]):
        return "AMQP 0-9-1 server answered the protocol header"
    return f"!not an AMQP 0-9-1 answer: {frame[:16]!r}"


async def _connected(_reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> str:
    return "accepts connections"


Greeting = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[str]]
_GREETINGS: dict[str, Greeting] = {"redis": _redis, "nats": _nats, "amqp": _amqp}
"""What each plain-text protocol's server is asked; a leading '!' marks an answer that is not its protocol."""
