"""The worker's health and metrics port: ``stepstone worker --metrics-port 9464``.

    GET /livez     200 while the worker's claim loop runs, and while it drains after a stop signal
                   (cheap: no database round trip)
    GET /readyz    200 when the database answers, the schema is current, the plans are registered and
                   the worker claims (not draining); 503 with the failing check otherwise (JSON body
                   either way)
    GET /metrics   Prometheus text format (the `prometheus` extra; 404 without it)

A plain asyncio server on the worker's loop: no extra dependency, one request per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from stepstone.store.observing import ObservingStore

log = logging.getLogger("stepstone.health")

__all__ = ["HealthServer", "Probed"]

_SAMPLE_EVERY = 10.0  # seconds between database samples of the queue gauges, per worker
_READ_TIMEOUT = 5.0
_MAX_HEADER_LINES = 100  # a probe sends a handful; more only keeps a connection (and its descriptor) open


class Probed(Protocol):
    """What the probes ask of the worker."""

    @property
    def alive(self) -> bool: ...
    @property
    def registered(self) -> bool: ...
    @property
    def claiming(self) -> bool: ...


@dataclass
class _Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    extra: str = ""  # more header lines, each ending in CRLF


_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}
_TOO_LARGE = _Response(431, b'{"error": "request line or headers too large"}')


class HealthServer:
    """Serves the probes and the metrics of one worker; `start()` binds, `stop()` closes."""

    def __init__(self, worker: Probed, store: ObservingStore, *, host: str = "0.0.0.0", port: int = 9464,  # noqa: S104 - a pod's probes come from outside it
                 metrics: Any = None) -> None:
        self.worker = worker
        self.store = store
        self.host = host
        self.requested_port = port
        self.metrics = metrics
        self._server: asyncio.Server | None = None
        self._sampled_at = float("-inf")

    @property
    def port(self) -> int:
        """The bound port (the requested one, or the one the system chose for port 0)."""
        assert self._server is not None
        assert self._server.sockets
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.requested_port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            parts, response = await self._read(reader)
        except (TimeoutError, ConnectionError, UnicodeDecodeError):
            writer.close()
            return
        head = (f"HTTP/1.1 {response.status} {_REASONS.get(response.status, '')}\r\n"
                f"Content-Type: {response.content_type}\r\nContent-Length: {len(response.body)}\r\n"
                f"{response.extra}Connection: close\r\n\r\n")
        body = b"" if parts[:1] == ["HEAD"] else response.body  # HEAD: GET's headers without its body
        with contextlib.suppress(ConnectionError):
            writer.write(head.encode() + body)
            await writer.drain()
        writer.close()

    async def _read(self, reader: asyncio.StreamReader) -> tuple[list[str], _Response]:
        """The request line's words and the answer; 431 for a line over the reader's 64 KiB, which readline
        raises as a ValueError (it escaped the callback: no answer, and asyncio's traceback in the log), or
        for more header lines than a probe sends."""
        try:
            async with asyncio.timeout(_READ_TIMEOUT):  # not wait_for: on 3.11 it can lose a cancellation
                request = await reader.readline()
            for _ in range(_MAX_HEADER_LINES):
                async with asyncio.timeout(_READ_TIMEOUT):
                    line = await reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
            else:
                return [], _TOO_LARGE
        except ValueError:
            return [], _TOO_LARGE
        parts = request.decode("latin-1").split()
        return parts, await self._route(parts)

    async def _route(self, parts: list[str]) -> _Response:
        method, path = (parts[0], parts[1].split("?", 1)[0]) if len(parts) >= 2 else ("", "")
        if method not in ("GET", "HEAD"):
            return _Response(405, b'{"error": "GET only"}', extra="Allow: GET, HEAD\r\n")  # RFC 9110: 405 says which
        if path in ("/livez", "/healthz"):
            ok = self.worker.alive
            return _Response(200 if ok else 503, json.dumps({"alive": ok}).encode())
        if path == "/readyz":
            checks = await self.readiness()
            ok = all(checks.values())
            return _Response(200 if ok else 503, json.dumps({"ready": ok, "checks": checks}).encode())
        if path == "/metrics":
            return await self._metrics()
        return _Response(404, b'{"error": "not found"}')

    async def _metrics(self) -> _Response:
        if self.metrics is None:
            return _Response(404, b"metrics need the prometheus extra: pip install 'stepstone[prometheus]'\n",
                             "text/plain")
        await self._sample()
        return _Response(200, self.metrics.exposition(), "text/plain; version=0.0.4; charset=utf-8")

    async def readiness(self) -> dict[str, bool]:
        """database: answers; schema: at the shipped version; plans: registered by this worker; claiming: it
        takes new work (not once a stop signal has it draining)."""
        checks = {"database": False, "schema": False, "plans": self.worker.registered,
                  "claiming": self.worker.claiming}
        try:
            await self.store.ping()
            checks["database"] = True
            checks["schema"] = await self.store.schema_current()
        except Exception as exc:  # noqa: BLE001 - a probe reports, it never raises
            log.debug("readiness check failed (%s: %s)", type(exc).__name__, exc)
        return checks

    async def _sample(self) -> None:
        now = time.monotonic()
        if now - self._sampled_at < _SAMPLE_EVERY:
            return
        self._sampled_at = now
        try:
            sample = await self.store.sample()
        except Exception as exc:  # noqa: BLE001 - metrics report what they have
            log.debug("metrics sample failed (%s: %s)", type(exc).__name__, exc)
            return
        if sample is not None:
            self.metrics.record_sample(sample)
