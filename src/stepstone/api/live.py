"""Live updates: one LISTEN connection per app, fanned out to every server-sent-event stream.

The store notifies when an instance completes, fails or is cancelled (`ClientStore.listen_settled`);
the broadcaster opens that listener on the first subscriber and hands each notification (the
instance id) to every subscriber's queue. A slow subscriber loses notifications beyond its queue,
never blocks the others: a page that missed one is refreshed by the next, or by its own reload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from stepstone.store.port import ClientStore, Listener

__all__ = ["Broadcaster"]

log = logging.getLogger("stepstone.api.live")


class Broadcaster:
    def __init__(self, store: ClientStore, *, queue_size: int = 100) -> None:
        self.store = store
        self.queue_size = queue_size
        self._subscribers: set[asyncio.Queue[str]] = set()
        self._listener: Listener | None = None
        self._lock = asyncio.Lock()

    def _deliver(self, instance_id: str) -> None:
        for queue in list(self._subscribers):
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(instance_id)

    async def subscribe(self) -> asyncio.Queue[str]:
        async with self._lock:
            if self._listener is None or not self._listener.alive:
                self._listener = await self.store.listen_settled(self._deliver)
        queue: asyncio.Queue[str] = asyncio.Queue(self.queue_size)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[str]) -> None:
        self._subscribers.discard(queue)

    async def close(self) -> None:
        async with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            await listener.close()
