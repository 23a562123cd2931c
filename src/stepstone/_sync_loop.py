"""The private event loop thread `SyncClient` runs `Client`'s coroutines on (its generated methods and
mixins call `_run`; see `stepstone._gen_sync`)."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

from stepstone.errors import ClientClosed, InvalidInput

if TYPE_CHECKING:
    from stepstone.client import Client

__all__ = ["SyncLoop", "on_sync_loop"]

T = TypeVar("T")

_SYNC_LOOPS: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()

# How long the caller's thread waits for a call before it looks at the signals it was sent: a Ctrl-C
# that the kernel gave to another thread (the loop thread, a timer's) sets Python's flag without waking
# a thread blocked on a lock, so a wait without a bound would see it only when the call ends.
_SIGNAL_CHECK_SECONDS = 0.2


def on_sync_loop() -> bool:
    """Whether the running coroutine runs on a SyncClient's loop thread (for a call made through it)."""
    return asyncio.get_running_loop() in _SYNC_LOOPS


class _Call(Generic[T]):
    """A coroutine handed to the loop thread. `begin` and `stop` both run on that thread, in the order the
    caller sent them, so a stop sent at any point after the hand-over finds the call begun (and cancels
    it) or not (and closes the coroutine unrun). `ended` is a bare lock, released when the task is done:
    the caller's wait holds no condition that an interrupt could leave taken, with the loop thread then
    blocked on it for ever (a concurrent.futures.Future's result() can, bpo-29988)."""

    __slots__ = ("coro", "ended", "task")

    def __init__(self, coro: Coroutine[Any, Any, T]) -> None:
        self.coro: Coroutine[Any, Any, T] | None = coro
        self.task: asyncio.Task[T] | None = None
        self.ended = threading.Lock()
        self.ended.acquire()

    def begin(self) -> None:
        coro, self.coro = self.coro, None
        if coro is not None:
            self.task = asyncio.get_running_loop().create_task(coro)
            self.task.add_done_callback(lambda _: self.ended.release())

    def stop(self) -> None:
        if self.task is None:
            coro, self.coro = self.coro, None
            if coro is not None:
                coro.close()  # never to run: no "coroutine was never awaited" warning either
        else:
            self.task.cancel()
            self.task.add_done_callback(_drop_outcome)  # nobody will ask for it: no "never retrieved"


def _drop_outcome(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _cancel_the_rest() -> None:
    """Cancel and wait for the loop's other tasks (an interrupted call ending, or close() itself when it
    was interrupted), so that none is destroyed pending when the loop stops."""
    rest = asyncio.all_tasks() - {asyncio.current_task()}
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)


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
        call = _Call(coro)
        try:
            self._loop.call_soon_threadsafe(call.begin)
            while not call.ended.acquire(timeout=_SIGNAL_CHECK_SECONDS):
                pass  # (a signal handled on another thread raises here, at the latest one check later)
        except BaseException:
            # KeyboardInterrupt (Ctrl-C) anywhere from the hand-over on: stop the call on the loop thread
            # too, rather than leave it running (starting, waiting) behind the caller's back.
            self._loop.call_soon_threadsafe(call.stop)
            raise
        assert call.task is not None  # (ended is released by the task only)
        return call.task.result()

    def _stop_loop(self) -> None:
        def stop(_: object) -> None:
            self._loop.stop()

        def finish() -> None:
            self._loop.create_task(_cancel_the_rest()).add_done_callback(stop)

        self._loop.call_soon_threadsafe(finish)
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
