"""A TCP proxy between the workers and PostgreSQL that cuts connections on demand.

``reset_all()`` aborts every proxied connection on both sides (the peers see a reset);
``blackhole(seconds)`` (or ``cut()`` then ``heal()``) stops forwarding any byte in either direction and
holds new connections for that long, the way a partition shorter than TCP's retransmission timeout looks:
nothing arrives, nothing fails, then everything queued is delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Pair:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter


@dataclass
class Proxy:
    target_host: str
    target_port: int
    host: str = "127.0.0.1"
    port: int = 0
    resets: int = 0
    connections: int = 0
    _pairs: set[_Pair] = field(default_factory=set)  # type: ignore[arg-type]
    _open: asyncio.Event = field(default_factory=asyncio.Event)
    _server: asyncio.Server | None = None

    async def start(self) -> None:
        self._open.set()
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    def url(self, database: str) -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/{database}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.reset_all()
        if self._server is not None:
            await self._server.wait_closed()

    def reset_all(self) -> int:
        """Abort every live connection with a TCP reset; returns how many."""
        pairs, self._pairs = self._pairs, set()
        for pair in pairs:
            for w in (pair.client, pair.upstream):
                _abort(w)
        self.resets += 1
        return len(pairs)

    async def blackhole(self, seconds: float) -> None:
        """Forward nothing for `seconds` (then resume, delivering what was queued)."""
        self.cut()
        try:
            await asyncio.sleep(seconds)  # the length of the partition itself
        finally:
            self.heal()

    def cut(self) -> None:
        """Forward nothing, in either direction, until `heal()`; new connections wait too."""
        self._open.clear()

    def heal(self) -> None:
        """Forward again, delivering what was queued during the cut."""
        self._open.set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._open.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            _abort(writer)
            return
        pair = _Pair(writer, up_writer)
        self._pairs.add(pair)
        self.connections += 1
        await asyncio.gather(self._pump(reader, up_writer, pair), self._pump(up_reader, writer, pair),
                             return_exceptions=True)
        self._pairs.discard(pair)
        for w in (writer, up_writer):
            with contextlib.suppress(Exception):
                w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pair: _Pair) -> None:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            await self._open.wait()
            if pair not in self._pairs:
                return
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(Exception):
            writer.write_eof()


def _abort(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(Exception):
        writer.transport.abort()
