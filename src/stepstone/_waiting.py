"""Waiting for an event with a deadline, without `asyncio.wait_for`; cancelling a task and awaiting its end.

On Python 3.11, `asyncio.wait_for` returns the awaited result when its task is cancelled in the same
loop iteration as that result arrives, and the cancellation is lost (CPython gh-86296, fixed in 3.12):
a loop that waits this way can run on after its task was cancelled. `asyncio.timeout` awaits in the
caller's own task, so a cancellation always reaches it.

Awaiting a task one cancelled raises its CancelledError, which the caller means to swallow; a cancellation
of the caller's own task arriving during that await raises the same error, and must go through.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TypeVar

__all__ = ["cancel_and_wait", "wait_set"]

T = TypeVar("T")


async def wait_set(event: asyncio.Event, timeout: float) -> bool:
    """Until `event` is set or `timeout` seconds pass; whether it is set. A cancellation is never lost."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()
    return event.is_set()


async def cancel_and_wait(task: asyncio.Future[T]) -> T | None:
    """Cancel `task` and wait for its end: its result if it finished first, else None (its error, other than
    the cancellation, is raised). A cancellation of the calling task meanwhile is raised, never swallowed."""
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
        return None
