"""Serve an app with uvicorn on a free loopback port inside the test's event loop."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI


class _Server(uvicorn.Server):
    """A uvicorn server that says when its startup is over (it listens) and leaves signals alone."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.listening.set()

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


@asynccontextmanager
async def served(app: FastAPI) -> AsyncIterator[str]:
    """The base URL of `app` served on 127.0.0.1 (a free port), until the block ends."""
    server = _Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    listening = asyncio.create_task(server.listening.wait())
    await asyncio.wait({task, listening}, return_when=asyncio.FIRST_COMPLETED)
    if not listening.done():  # the server stopped before it listened: say why
        listening.cancel()
        task.result()
        raise RuntimeError("uvicorn stopped before it listened")
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
