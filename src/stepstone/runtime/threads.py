"""The threads synchronous handlers run in.

A Python thread cannot be interrupted: a synchronous handler still running when the
worker's drain timeout ends keeps its thread until it returns. These threads are
daemon threads, so such a handler never keeps the process from exiting (a standard
thread pool's threads are joined at interpreter exit, which hangs on a stuck handler).
`busy` says how many are running a handler now.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")

_Item = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class HandlerThreads(Executor):
    """Up to `max_workers` daemon threads, started on demand."""

    def __init__(self, max_workers: int, name_prefix: str = "stepstone-step") -> None:
        self._max = max_workers
        self._prefix = name_prefix
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._busy = 0
        self._shutdown = False

    @property
    def busy(self) -> int:
        """Threads running a handler right now."""
        with self._lock:
            return self._busy

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot run a handler after the worker stopped")
            self._queue.put((future, fn, args, kwargs))
            if self._idle > 0:
                self._idle -= 1
            elif len(self._threads) < self._max:
                thread = threading.Thread(
                    target=self._run, name=f"{self._prefix}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(None)
        if wait:
            for thread in threads:
                thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                with self._lock:
                    self._busy += 1
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting segment
                    future.set_exception(exc)
                else:
                    future.set_result(result)
                finally:
                    with self._lock:
                        self._busy -= 1
            with self._lock:
                self._idle += 1
