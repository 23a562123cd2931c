"""`ExternalWorker`: handlers per topic complete, raise business errors and fail tasks; a handler whose
lock was lost while it ran has its answer dropped, never sent on a stale token."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from stepstone.errors import Unavailable
from stepstone.external import BusinessError, ExternalTasks, ExternalWorker, LockedTask, TaskEnded
from stepstone.testing import Engine, open_engine
from tests.external import workflows
from tests.external.test_external_tasks import first_fetch
from tests.external.workflows import payment


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, workflows.registry, concurrency=2, lease_seconds=30) as e:
        yield e


async def _start(engine: Engine, *amounts: int) -> list[str]:
    ids = [await engine.client.start(payment, {"order_id": f"o-{a}", "amount": a}) for a in amounts]
    await engine.run_until_idle()
    return ids


async def test_handlers_complete_raise_and_fail(engine: Engine) -> None:
    ok, declined, broken = await _start(engine, 1, 2, 3)
    worker = ExternalWorker(ExternalTasks(engine.store), "py-1")

    @worker.subscribe("payments")
    def charge(task: LockedTask) -> dict[str, Any]:  # a sync handler runs in a thread
        amount = task.payload["amount"]
        if amount == 2:
            raise BusinessError("card_declined", "no funds", details={"limit": 1})
        if amount == 3:
            raise ConnectionError("gateway down")
        return {"charge_id": f"ch-{amount}"}

    assert await worker.run_once() == 3
    await engine.run_until_idle()
    assert (await engine.client.get(ok)).state["receipt"] == "o-1 paid with ch-1"
    assert (await engine.client.get(declined)).state["why"]["details"] == {"limit": 1}
    [task] = await worker.tasks.list(status="open")
    assert task["instance_id"] == broken and task["retries"] == 2 and "gateway down" in task["last_error"]


class Unreadable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message")


async def test_an_error_whose_message_cannot_be_read_is_still_reported_as_a_failure(engine: Engine) -> None:
    """As a step's: it ended the worker's loop and left the task locked without an answer."""
    [iid] = await _start(engine, 4)
    worker = ExternalWorker(ExternalTasks(engine.store), "py-1")

    @worker.subscribe("payments")
    def charge(task: LockedTask) -> dict[str, Any]:
        raise Unreadable

    assert await worker.run_once() == 1
    [task] = await worker.tasks.list(status="open")
    assert (task["instance_id"], task["retries"]) == (iid, 2)
    assert task["last_error"] == "Unreadable: (the error's message could not be read)"


async def test_a_handler_whose_lock_was_lost_sends_nothing(engine: Engine) -> None:
    [iid] = await _start(engine, 5)
    release = asyncio.Event()
    entered = asyncio.Event()
    worker = ExternalWorker(ExternalTasks(engine.store), "slow", lock_duration=3)

    @worker.subscribe("payments")
    async def charge(task: LockedTask) -> dict[str, Any]:
        entered.set()
        await release.wait()
        return {"charge_id": "slow"}

    round_ = asyncio.create_task(worker.run_once())
    await entered.wait()
    await engine.move_clock(10)  # the lock expired (db clock); another worker takes the task
    other = ExternalTasks(engine.store)
    [taken] = await other.fetch_and_lock("fast", ["payments"])
    release.set()
    assert await round_ == 0 and worker.dropped == 1
    await other.complete(taken.id, taken.lock_token, {"charge_id": "fast"})
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).state["charge_id"] == "fast"


async def test_a_handler_whose_instance_was_cancelled_is_told_why_its_answer_is_dropped(
    engine: Engine, caplog: pytest.LogCaptureFixture,
) -> None:
    """The lock extension the worker makes while the handler runs is refused once the instance is
    cancelled (not_awaited): the answer is dropped, and the log says why rather than "the lock was lost"."""
    [iid] = await _start(engine, 5)
    tasks = ExternalTasks(engine.store)
    refused = asyncio.Event()
    extend = tasks.extend_lock

    async def watched_extend(task_id: str, lock_token: str, lock_duration: float) -> Any:
        try:
            return await extend(task_id, lock_token, lock_duration)
        except TaskEnded:
            refused.set()
            raise

    tasks.extend_lock = watched_extend  # type: ignore[method-assign]
    worker = ExternalWorker(tasks, "slow", lock_duration=0.3)

    @worker.subscribe("payments")
    async def charge(task: LockedTask) -> dict[str, Any]:
        await engine.client.cancel(iid, "customer left")
        await refused.wait()  # the worker's next extension of the lock was refused
        return {"charge_id": "unwanted"}

    with caplog.at_level(logging.WARNING, logger="stepstone.external.worker"):
        assert await worker.run_once() == 0
    assert worker.dropped == 1
    assert "not_awaited" in caplog.text and "dropped" in caplog.text
    assert (await engine.client.get(iid)).status == "CANCELLED"


async def test_run_stops_when_asked(engine: Engine) -> None:
    worker = ExternalWorker(ExternalTasks(engine.store, poll_interval=0.05), "idle", long_poll=20)
    worker.subscribe("payments")(lambda _task: None)
    stop = asyncio.Event()
    fetched = first_fetch(worker.tasks)
    running = asyncio.create_task(worker.run(stop))
    await asyncio.wait_for(fetched.wait(), 10)  # the worker's long poll found nothing and waits
    stop.set()
    await asyncio.wait_for(running, 5)  # the long poll is given up at once
    await worker.tasks.close()


async def test_a_round_whose_answer_fails_still_finishes_its_other_handlers(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer that failed (the database away for a moment) ended the round at once: the other handlers
    of its fetch went on running with nobody awaiting them, beside the next round's fetch (more than
    `max_tasks` at a time), their answers' errors never retrieved, and `run` returned while they ran."""
    await _start(engine, 6, 7)
    tasks = ExternalTasks(engine.store)
    worker = ExternalWorker(tasks, "py-1")
    release, failed = asyncio.Event(), asyncio.Event()
    complete = tasks.complete

    async def flaky(task_id: str, lock_token: str, variables: dict[str, Any] | None = None, **kw: Any) -> Any:
        if variables == {"charge_id": "ch-6"}:
            failed.set()
            raise Unavailable("the database is away")
        return await complete(task_id, lock_token, variables, **kw)

    monkeypatch.setattr(tasks, "complete", flaky)

    @worker.subscribe("payments")
    async def charge(task: LockedTask) -> dict[str, Any]:
        if task.payload["amount"] == 7:
            await release.wait()
        return {"charge_id": f"ch-{task.payload['amount']}"}

    round_ = asyncio.create_task(worker.run_once())
    await failed.wait()
    release.set()
    with pytest.raises(Unavailable):
        await round_
    assert worker.answered == 1, "the other handler ran to its answer before the round ended"
