"""`wait_set`, the services' wait for an event with a deadline: what asyncio.wait_for did, without losing a
cancellation that arrives with the event (asyncio.wait_for on Python 3.11, CPython gh-86296)."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import pytest

from stepstone._waiting import wait_set


async def test_set_before_or_during_the_wait() -> None:
    event = asyncio.Event()
    event.set()
    assert await wait_set(event, 0) is True
    event.clear()
    waiter = asyncio.create_task(wait_set(event, 30))
    await asyncio.sleep(0)  # one loop iteration: it waits on the event now
    event.set()
    assert await waiter is True


async def test_the_timeout_ends_the_wait_unset() -> None:
    event = asyncio.Event()
    assert await wait_set(event, 0) is False
    assert await wait_set(event, -1) is False
    assert await wait_set(event, 0.001) is False


async def test_a_cancellation_is_raised() -> None:
    waiter = asyncio.create_task(wait_set(asyncio.Event(), 30))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def test_a_cancellation_arriving_with_the_event_is_not_lost() -> None:
    rounds: list[bool] = []
    event = asyncio.Event()

    async def service() -> None:
        while True:
            rounds.append(await wait_set(event, 30))
            event.clear()

    task = asyncio.create_task(service())
    await asyncio.sleep(0)
    event.set()
    task.cancel()  # in the same loop iteration as the event
    with pytest.raises(asyncio.CancelledError):
        await task
    assert rounds == []


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="asyncio.wait_for was fixed in Python 3.12")
async def test_asyncio_wait_for_loses_that_cancellation_here() -> None:
    # The reason for wait_set: if this stops failing to cancel, the Python in use no longer has the bug.
    event = asyncio.Event()

    async def waits() -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), 30)
        return event.is_set()

    task = asyncio.create_task(waits())
    await asyncio.sleep(0)
    event.set()
    task.cancel()
    assert await task is True  # the cancellation was swallowed


async def test_an_outer_timeout_still_reaches_the_caller() -> None:
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0):
            await wait_set(asyncio.Event(), 30)
