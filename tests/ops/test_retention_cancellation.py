"""`RetentionLoop.stop` cancels its loop's task and awaits its end: a cancellation of the task that calls stop
arriving during that await goes through, where `contextlib.suppress(asyncio.CancelledError)` swallowed it and
the caller went on as if not cancelled."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from stepstone.ops.retention import RetentionLoop
from tests._lingering import linger_when_cancelled


async def test_a_cancellation_while_stop_awaits_the_loops_end_is_not_swallowed() -> None:
    store: Any = object()  # never used: the loop's task is the lingering one below
    retention = RetentionLoop(store, 1.0)
    cancelled, release = asyncio.Event(), asyncio.Event()
    retention._task = asyncio.create_task(linger_when_cancelled(cancelled, release))
    stopping = asyncio.create_task(retention.stop())
    await cancelled.wait()  # stop cancelled the loop and awaits its end
    stopping.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert stopping.cancelled()


async def test_stop_ends_the_loop() -> None:
    store: Any = object()
    retention = RetentionLoop(store, 1.0)
    cancelled, release = asyncio.Event(), asyncio.Event()
    release.set()
    loop_task = asyncio.create_task(linger_when_cancelled(cancelled, release))
    retention._task = loop_task
    await retention.stop()
    assert loop_task.cancelled() and retention._task is None
