"""Waking `Client.wait_for` when an instance settles: one LISTEN connection shared by every waiter."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from stepstone.errors import DatabaseUnavailable

if TYPE_CHECKING:
    from stepstone.store.port import ClientStore, Listener

__all__ = ["SettledWatch"]


class SettledWatch:
    """Events per instance id, set when the instance's settle notification arrives.

    The listener opens on the first `watch` and again after its connection is lost; while it is
    down, waiters fall back to re-reading every `fallback_seconds`.
    """

    fallback_seconds = 1.0

    def __init__(self, store: ClientStore) -> None:
        self.store = store
        self.listener: Listener | None = None
        self.waiters: dict[str, set[asyncio.Event]] = {}
        self._opening = asyncio.Lock()

    async def watch(self, instance_id: str) -> asyncio.Event:
        event = asyncio.Event()
        self.waiters.setdefault(instance_id, set()).add(event)
        try:
            async with self._opening:
                if self.listener is None or not self.listener.alive:
                    try:
                        self.listener = await self.store.listen_settled(self._notified)
                    except DatabaseUnavailable:
                        self.listener = None  # the fallback re-read still ends the wait
        except BaseException:  # cancelled (or failed) while the listener connects: the caller never unwatches
            self.unwatch(instance_id, event)
            raise
        return event

    def unwatch(self, instance_id: str, event: asyncio.Event) -> None:
        events = self.waiters.get(instance_id)
        if events is not None:
            events.discard(event)
            if not events:
                del self.waiters[instance_id]

    def _notified(self, instance_id: str) -> None:
        for event in self.waiters.get(instance_id, ()):
            event.set()

    async def close(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            with contextlib.suppress(Exception):  # closing a lost connection must not mask close()
                await listener.close()
