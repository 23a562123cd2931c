"""Counters a service bumps and tests wait on (`wait_until`), so no test sleeps to wait for work."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Counters"]


@dataclass
class Counters:
    """Subclasses declare their counters as int fields; `count` bumps one and wakes the waiters whose
    condition now holds."""

    _waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = field(default_factory=list, repr=False)

    def count(self, name: str, by: int = 1) -> None:
        setattr(self, name, getattr(self, name) + by)
        for predicate, future in self._waiters:
            if not future.done() and predicate():
                future.set_result(None)

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = 30.0) -> None:
        if predicate():
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = (predicate, future)
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can lose a cancellation
                await future
        finally:
            self._waiters.remove(waiter)
