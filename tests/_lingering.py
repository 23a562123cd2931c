"""A task that is slow to end once cancelled: a test cancels the task that awaits its end meanwhile."""

from __future__ import annotations

import asyncio


async def linger_when_cancelled(cancelled: asyncio.Event, release: asyncio.Event) -> None:
    """Never returns; once cancelled, sets `cancelled` and ends (cancelled) only when `release` is set."""
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        cancelled.set()
        await release.wait()
        raise
