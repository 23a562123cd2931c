"""`wait_set`, the services' wait for an event with a deadline: what asyncio.wait_for did, without losing a
cancellation that arrives with the event (asyncio.wait_for on Python 3.11, CPython gh-86296)."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import pytest

from stepstone._waiting import cancel_and_wait, wait_set


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


async def test_cancel_and_wait_answers_the_result_or_none_and_raises_the_tasks_error() -> None:
    done = asyncio.create_task(asyncio.sleep(0, result=7))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert done.done() and await cancel_and_wait(done) == 7  # finished first: its result
    sleeper = asyncio.create_task(asyncio.Event().wait())  # pending until cancelled
    await asyncio.sleep(0)
    assert await cancel_and_wait(sleeper) is None and sleeper.cancelled()

    async def fails_when_cancelled() -> None:
        try:
            await asyncio.Event().wait()  # pending until cancelled
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    failing = asyncio.create_task(fails_when_cancelled())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="cleanup failed"):
        await cancel_and_wait(failing)


async def test_cancel_and_wait_lets_a_cancellation_of_its_caller_through() -> None:
    """The caller is cancelled while it awaits the end of the task it cancelled: that CancelledError is the
    caller's own and goes through (a suppress(CancelledError) around the await swallowed it)."""
    release = asyncio.Event()

    async def slow_to_end() -> None:
        try:
            await asyncio.Event().wait()  # pending until cancelled
        except asyncio.CancelledError:
            await release.wait()  # its cleanup takes a while
            raise

    inner = asyncio.create_task(slow_to_end())
    await asyncio.sleep(0)
    outer = asyncio.create_task(cancel_and_wait(inner))
    await asyncio.sleep(0)  # outer awaits inner's end now
    await asyncio.sleep(0)
    outer.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert inner.cancelled()
