"""Waiting for an event with a deadline, without `asyncio.wait_for`.

On Python 3.11, `asyncio.wait_for` returns the awaited result when its task is cancelled in the same
loop iteration as that result arrives, and the cancellation is lost (CPython gh-86296, fixed in 3.12):
a loop that waits this way can run on after its task was cancelled. `asyncio.timeout` awaits in the
caller's own task, so a cancellation always reaches it.
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["wait_set"]


async def wait_set(event: asyncio.Event, timeout: float) -> bool:
    """Until `event` is set or `timeout` seconds pass; whether it is set. A cancellation is never lost."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()
    return event.is_set()
