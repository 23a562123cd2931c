"""`ExternalWorker` cancels a task of its own (the fetch when `stop` is set, the lock keeper when the handler
returns) and awaits its end: a cancellation of the worker's own task arriving during that await goes
through, where `contextlib.suppress(asyncio.CancelledError)` swallowed it and the worker went on."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest

from stepstone.external import ExternalWorker, LockedTask, TaskLockRefused
from tests._lingering import linger_when_cancelled


class SlowToCancel:
    """A fake of the ExternalTasks a worker uses: the fetch never returns, and when cancelled it lingers until
    `release` is set, so the test cancels the worker exactly while it awaits the fetch's end."""

    def __init__(self) -> None:
        self.fetching = asyncio.Event()
        self.fetch_cancelled = asyncio.Event()
        self.release = asyncio.Event()
        self.completed: list[str] = []

    async def fetch_and_lock(self, *_args: Any, **_kw: Any) -> list[LockedTask]:
        self.fetching.set()
        await linger_when_cancelled(self.fetch_cancelled, self.release)
        return []

    async def complete(self, task_id: str, *_args: Any, **_kw: Any) -> None:
        self.completed.append(task_id)


TASK = LockedTask(id="t-1", lock_token="tok",  # noqa: S106 - a fake task's token
                  topic="t", payload={}, lock_until=datetime.now(UTC),
                  instance_id="i-1", position="", step="s", visit=1, definition_id="d", version=1,
                  business_key=None, retries=3, attempts=0, last_error=None,
                  created_at=datetime.now(UTC))


async def test_a_cancellation_while_the_stopped_fetch_ends_is_not_swallowed() -> None:
    tasks = SlowToCancel()
    worker = ExternalWorker(tasks, "w-1")  # type: ignore[arg-type]  # the fake has what run_once calls
    worker.subscribe("t")(lambda _task: None)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_once(timeout=10, stop=stop))
    await tasks.fetching.wait()
    stop.set()  # run_once cancels the fetch and awaits its end
    await tasks.fetch_cancelled.wait()
    run.cancel()
    tasks.release.set()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert run.cancelled()


class SlowKeeper(ExternalWorker):
    """A worker whose lock keeper, once cancelled, lingers until `release` is set."""

    def __init__(self, tasks: Any) -> None:
        super().__init__(tasks, "w-2")
        self.keeper_cancelled = asyncio.Event()
        self.release = asyncio.Event()

    async def _keep(self, task: LockedTask) -> TaskLockRefused:  # noqa: ARG002 - the overridden signature
        await linger_when_cancelled(self.keeper_cancelled, self.release)
        raise AssertionError("unreachable")


async def test_a_cancellation_while_the_keeper_ends_is_not_swallowed_and_nothing_is_answered() -> None:
    tasks = SlowToCancel()
    worker = SlowKeeper(tasks)
    worker.subscribe("t")(lambda _task: {"ok": True})
    handle = asyncio.create_task(worker._handle(TASK))
    await worker.keeper_cancelled.wait()  # the handler returned; _handle awaits the keeper's end
    handle.cancel()
    worker.release.set()
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert (tasks.completed, worker.answered) == ([], 0)
