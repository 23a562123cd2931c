"""When an idle worker's claim loop claims again: at once for a command due now, else when the earliest
notified command comes due, else at the poll (the claim loop's own timeout)."""

from __future__ import annotations

import asyncio
import heapq

from stepstone.runtime.worker_config import WorkerConfig

_MAX_DUES = 1024
"""Future commands a worker keeps a wake-up for (those due within the poll interval); beyond it, the poll
covers them: a flood of notifications cannot grow a worker without bound."""


class WakeUps:
    """The claim loop waits on `event`; notifications (`notified`) and armed due times set it."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.event = asyncio.Event()
        self._dues: list[float] = []  # loop times of notified future commands, a heap
        self._due: asyncio.TimerHandle | None = None  # the wake-up armed for the earliest of them

    def notified(self, due_in: float) -> None:
        """A notification: claim now for a command due now (or within the coalescing interval), else
        wake up when it is due. Measured on the signal->step bench: without this, the timer a wait with
        a timeout inserts woke every idle worker for an empty claim, and the signal that followed
        waited out `min_wake_interval` behind it. A command due after the poll interval needs no
        wake-up of its own: the poll claims before then, and a claim that finds nothing looks up the
        next due time."""
        if due_in <= self.config.min_wake_interval:
            self.event.set()
        elif due_in <= self.config.poll_interval and len(self._dues) < _MAX_DUES:
            loop = asyncio.get_running_loop()
            when = loop.time() + due_in
            heapq.heappush(self._dues, when)
            if self._due is None or when < self._due.when():
                self._arm(loop)

    def forget(self) -> None:
        """Drop every armed wake-up (the notifications' connection is closing)."""
        self._dues.clear()
        self._arm(asyncio.get_running_loop())

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._due is not None:
            self._due.cancel()
        self._due = loop.call_at(self._dues[0], self._due_now) if self._dues else None

    def _due_now(self) -> None:
        loop = asyncio.get_running_loop()
        while self._dues and self._dues[0] <= loop.time() + self.config.min_wake_interval:
            heapq.heappop(self._dues)
        self.event.set()
        self._arm(loop)
