"""Serving an HTTP app from a command until SIGTERM/SIGINT (`stepstone serve`, `stepstone external serve`).

The command owns the stop signals: the first one ends the block of `stop_signals()`, uvicorn then shuts
down gracefully and the command exits 0 like the worker and the relay. Left to uvicorn, the signal was
re-raised after its shutdown, and the process died of it (143, or click's "Aborted!" and 1 for SIGINT)
before it closed its store.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

__all__ = ["quiet_server", "stop_signals"]

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def quiet_server(uvicorn: Any, config: Any) -> Any:
    """A uvicorn server that leaves signals to its caller (uvicorn would install its own handlers and
    re-raise the stop signal after its graceful shutdown)."""

    class Server(uvicorn.Server):  # type: ignore[misc]
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server(config)


@contextlib.asynccontextmanager
async def stop_signals() -> AsyncIterator[asyncio.Event]:
    """An event the first SIGTERM or SIGINT sets while the block runs; the handlers go with the block."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in _STOP_SIGNALS:
            loop.remove_signal_handler(sig)
