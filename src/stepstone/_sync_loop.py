"""The private event loop thread `SyncClient` runs `Client`'s coroutines on (its generated methods and
mixins call `_run`; see `stepstone._gen_sync`)."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Self, TypeVar

from stepstone.errors import ClientClosed, InvalidInput

if TYPE_CHECKING:
    from stepstone.client import Client

__all__ = ["SyncLoop", "on_sync_loop"]

T = TypeVar("T")

_SYNC_LOOPS: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def on_sync_loop() -> bool:
    """Whether the running coroutine runs on a SyncClient's loop thread (for a call made through it)."""
    return asyncio.get_running_loop() in _SYNC_LOOPS


class SyncLoop:
    """A loop thread and the async `Client` on it; `SyncClient.__init__` starts both."""

    _client: Client
    _loop: asyncio.AbstractEventLoop
    _thread: threading.Thread

    def _start_loop(self) -> None:
        self._loop = asyncio.new_event_loop()
        _SYNC_LOOPS.add(self._loop)
        self._thread = threading.Thread(target=self._loop.run_forever, name="stepstone-client", daemon=True)
        self._thread.start()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():  # a call after close(): say so, instead of "Event loop is closed"
            coro.close()  # never to run: no "coroutine was never awaited" warning either
            raise ClientClosed("this SyncClient is closed")
        if threading.get_ident() == self._thread.ident:
            # A callback one of our calls runs on the loop thread (on_batch, state_transform): waiting here
            # for the loop would block the loop itself, for ever.
            name = getattr(coro, "__name__", "a method")
            coro.close()
            raise InvalidInput(
                f"SyncClient.{name} was called on the client's own loop thread, from a callback one of "
                "its calls runs (on_batch, state_transform, ...): it would wait for itself for ever; call it after "
                "that call returns", what="thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    @property
    def client(self) -> Client:
        """The async `Client` underneath (its coroutines run on this object's loop thread only)."""
        return self._client

    def close(self) -> None:
        """Close the connection pool and stop the loop thread; closing again does nothing."""
        if self._loop.is_closed():
            return
        try:
            self._run(self._client.close())
        finally:
            self._stop_loop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
