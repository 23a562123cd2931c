"""External tasks against a real PostgreSQL: fetch and lock, complete with variables, business
errors, failures with retries and backoff, incidents and their retry, fencing by lock token and
lock expiry, concurrent fetches that never hand one task to two workers, tasks inside branches."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import pytest

from stepstone.external import ExternalTasks, LockedTask, LockExpired, LockLost, TaskEnded
from stepstone.ops import Operations
from stepstone.testing import Engine, open_engine
from tests.external import workflows
from tests.external.workflows import payment, shipping


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, workflows.registry, concurrency=4, lease_seconds=30) as e:
        yield e


@pytest.fixture
async def tasks(engine: Engine) -> AsyncIterator[ExternalTasks]:
    service = ExternalTasks(engine.store, poll_interval=0.05)
    yield service
    await service.close()  # its LISTEN connection, when a long poll opened one


async def _started(engine: Engine, order: str = "A-1", amount: int = 42) -> str:
    iid = await engine.client.start(payment, {"order_id": order, "amount": amount})
    await engine.run_until_idle()
    return iid


async def _one(tasks: ExternalTasks, worker: str = "w1", topic: str = "payments", **kw: float) -> LockedTask:
    [task] = await tasks.fetch_and_lock(worker, [topic], max_tasks=5, **kw)
    return task


async def test_complete_merges_variables_and_the_instance_goes_on(engine: Engine, tasks: ExternalTasks) -> None:
    iid = await _started(engine)
    info = await engine.client.get(iid)
    assert info.status == "WAITING" and info.waiting_for["kind"] == "external"
    task = await _one(tasks)
    assert task.instance_id == iid and task.topic == "payments" and task.step == "charge"
    assert task.payload == {"order_id": "A-1", "amount": 42}  # only the step's inputs
    assert task.definition_id == "payment" and task.retries == 3
    assert await tasks.fetch_and_lock("w2", ["payments"]) == []  # locked: nobody else gets it

    answer = await tasks.complete(task.id, task.lock_token, {"charge_id": "ch-1"}, worker_id="w1")
    assert answer.status == "COMPLETED" and answer.command_id is not None and not answer.duplicate
    again = await tasks.complete(task.id, task.lock_token, {"charge_id": "ch-1"})
    assert again.duplicate and again.command_id == answer.command_id  # a retried reply, not a second answer
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED"
    assert info.state["receipt"] == "A-1 paid with ch-1"
    kinds = [h["kind"] for h in await engine.client.history(iid)]
    assert "EXTERNAL_TASK_OPENED" in kinds and "EXTERNAL_TASK_COMPLETED" in kinds


async def test_a_business_error_takes_its_route(engine: Engine, tasks: ExternalTasks) -> None:
    iid = await _started(engine)
    task = await _one(tasks)
    answer = await tasks.raise_error(task.id, task.lock_token, "card_declined", "insufficient funds")
    assert answer.status == "ERROR"
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["declined"] is True
    assert info.state["why"] == {"code": "card_declined", "message": "insufficient funds", "details": None}


async def test_an_unknown_business_error_is_an_incident(engine: Engine, tasks: ExternalTasks) -> None:
    iid = await _started(engine)
    task = await _one(tasks)
    await tasks.raise_error(task.id, task.lock_token, "fraud", "flagged")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED" and info.error["type"] == "ExternalTaskError"


async def test_failures_retry_with_backoff_then_an_incident_an_operator_retries(
    engine: Engine, tasks: ExternalTasks
) -> None:
    iid = await _started(engine)
    task = await _one(tasks)
    first = await tasks.fail(task.id, task.lock_token, "gateway timeout")
    assert first.status == "OPEN" and first.retries == 2
    assert await tasks.fetch_and_lock("w1", ["payments"]) == []  # backing off: 10 s (the step's backoff)
    await engine.move_clock(9)
    assert await tasks.fetch_and_lock("w1", ["payments"]) == []
    await engine.move_clock(1.5)
    task = await _one(tasks)
    assert task.attempts == 1 and task.last_error == "gateway timeout"
    second = await tasks.fail(task.id, task.lock_token, "gateway timeout")
    assert second.retries == 1
    await engine.move_clock(19)  # backoff doubles: 20 s
    assert await tasks.fetch_and_lock("w1", ["payments"]) == []
    await engine.move_clock(2)
    task = await _one(tasks)
    last = await tasks.fail(task.id, task.lock_token, "gateway gone", details={"http": 502})
    assert last.status == "FAILED" and last.command_id is not None
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED" and info.error["type"] == "ExternalTaskFailed"
    assert "gateway gone" in info.error["message"]

    await engine.client.retry(iid)  # the operator: the task is offered again with fresh retries
    await engine.run_until_idle()
    task = await _one(tasks)
    assert task.retries == 3 and task.attempts == 0
    await tasks.complete(task.id, task.lock_token, {"charge_id": "ch-9"})
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"


async def test_every_failed_attempt_is_in_the_history(engine: Engine, tasks: ExternalTasks) -> None:
    """A failure that is retried left no trace in the instance's history (only the task row's last
    error): an operator reading `stepstone history --failed` saw nothing of the attempts before the last."""
    iid = await _started(engine)
    task = await _one(tasks, "w1")
    first = await tasks.fail(task.id, task.lock_token, "gateway timeout", details={"http": 504})
    await engine.move_clock(11)
    task = await _one(tasks, "w2")
    await tasks.fail(task.id, task.lock_token, "gateway timeout", worker_id="w2-named", retry_delay=0)
    failed = (await engine.client.history_page(iid, failed_only=True)).entries
    assert [(e.kind, e.step, e.outcome) for e in failed] == [
        ("EXTERNAL_TASK_ATTEMPT_FAILED", "charge", "external task attempt failed")] * 2
    retry_at = failed[0].data.pop("available_at")
    assert failed[0].data == {"task_id": task.id, "worker": "w1", "message": "gateway timeout",
                              "details": {"http": 504}, "attempt": 1, "retries": 2}
    assert datetime.fromisoformat(retry_at) == first.available_at
    assert failed[1].data["worker"] == "w2-named" and failed[1].data["attempt"] == 2
    assert failed[1].data["retries"] == 1
    assert failed[0].actor is not None and (failed[0].actor.kind, failed[0].actor.id) == ("service", "w1")


async def test_a_retried_failure_sent_again_is_a_duplicate(engine: Engine, tasks: ExternalTasks) -> None:
    """A worker that lost the reply to its failure and sends it again got `lock_lost` ("another worker
    has it"), unlike a repeated completion: the retry had released the token. It is the first answer
    again now, marked duplicate, and nothing more is counted; other answers with that token are refused."""
    iid = await _started(engine)
    task = await _one(tasks)
    first = await tasks.fail(task.id, task.lock_token, "gateway timeout")
    again = await tasks.fail(task.id, task.lock_token, "gateway timeout")
    assert (again.status, again.duplicate, again.command_id) == ("OPEN", True, None)
    assert not first.duplicate and first.retries == 2
    [row] = await tasks.list()
    assert (row["attempts"], row["retries"]) == (1, 2)
    assert len((await engine.client.history_page(iid, failed_only=True)).entries) == 1
    with pytest.raises(LockLost):
        await tasks.complete(task.id, task.lock_token, {"charge_id": "late"})
    await engine.move_clock(11)
    refetched = await _one(tasks, "w2")
    assert (await tasks.fail(task.id, task.lock_token, "gateway timeout")).duplicate  # still that answer
    with pytest.raises(LockLost):
        await tasks.extend_lock(task.id, task.lock_token, 30)
    await tasks.complete(refetched.id, refetched.lock_token, {"charge_id": "ch-2"})
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).state["receipt"] == "A-1 paid with ch-2"
    late = await tasks.fail(task.id, task.lock_token, "gateway timeout")  # the task's status now, not OPEN
    assert (late.status, late.duplicate) == ("COMPLETED", True)


async def test_a_worker_may_set_retries_and_delay(engine: Engine, tasks: ExternalTasks) -> None:
    iid = await _started(engine)
    task = await _one(tasks)
    answer = await tasks.fail(task.id, task.lock_token, "try later", retries=5, retry_delay=0)
    assert answer.retries == 5
    task = await _one(tasks)
    answer = await tasks.fail(task.id, task.lock_token, "give up", retries=0)
    assert answer.status == "FAILED"
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "FAILED"


async def test_an_expired_lock_cannot_complete_and_the_task_goes_to_another_worker(
    engine: Engine, tasks: ExternalTasks
) -> None:
    iid = await _started(engine)
    slow = await _one(tasks, "slow", lock_duration=30)
    await engine.move_clock(20)
    await tasks.extend_lock(slow.id, slow.lock_token, 30)  # held until 50 s from the start
    await engine.move_clock(25)
    assert await tasks.fetch_and_lock("fast", ["payments"]) == []  # still held after the extension
    await engine.move_clock(10)
    with pytest.raises(LockExpired):
        await tasks.complete(slow.id, slow.lock_token, {"charge_id": "late"})
    with pytest.raises(LockExpired):
        await tasks.extend_lock(slow.id, slow.lock_token, 30)

    fast = await _one(tasks, "fast")  # the expired lock made it fetchable again
    assert fast.id == slow.id and fast.lock_token != slow.lock_token
    with pytest.raises(LockLost) as refused:  # the lock moved to another worker: typed refusal
        await tasks.complete(slow.id, slow.lock_token, {"charge_id": "late"})
    assert refused.value.reason == "lock_lost" and refused.value.task_id == slow.id
    with pytest.raises(LockLost):
        await tasks.fail(slow.id, slow.lock_token, "late")
    await tasks.complete(fast.id, fast.lock_token, {"charge_id": "ch-fast"})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["charge_id"] == "ch-fast"


async def test_a_cancelled_instance_task_is_not_handed_out_nor_completed(engine: Engine, tasks: ExternalTasks) -> None:
    held_iid = await _started(engine, "A-1")
    other_iid = await _started(engine, "A-2")
    [held] = await tasks.fetch_and_lock("w1", ["payments"], max_tasks=1)
    assert held.instance_id == held_iid
    await engine.client.cancel(held_iid, "customer left")
    await engine.client.cancel(other_iid, "customer left")
    with pytest.raises(TaskEnded) as refused:
        await tasks.complete(held.id, held.lock_token, {})
    assert refused.value.reason == "not_awaited"
    assert await tasks.fetch_and_lock("w1", ["payments"]) == []  # the other one is closed, not handed out
    assert {t["status"] for t in await tasks.list()} == {"CANCELLED"}


async def test_cancelling_the_instance_ends_its_task_at_once(engine: Engine, tasks: ExternalTasks) -> None:
    """Not only when a fetch or an answer trips over it: the list shows it ended, and the worker holding
    it learns so from its next lock extension (the ExternalWorker then drops its handler's answer)."""
    held_iid = await _started(engine, "A-1")
    other_iid = await _started(engine, "A-2")
    [held] = await tasks.fetch_and_lock("w1", ["payments"], max_tasks=1)
    await engine.client.cancel(held_iid, "customer left")
    await engine.client.cancel(other_iid, "customer left")
    listed = await tasks.list()
    assert {t["status"] for t in listed} == {"CANCELLED"}
    assert {t["last_error"] for t in listed} == {"NOT_AWAITED"}
    assert await tasks.list(status="open") == []
    with pytest.raises(TaskEnded) as refused:
        await tasks.extend_lock(held.id, held.lock_token, 30)
    assert refused.value.reason == "not_awaited" and refused.value.status == "CANCELLED"
    with pytest.raises(TaskEnded) as refused:
        await tasks.complete(held.id, held.lock_token, {})
    assert refused.value.reason == "not_awaited"


async def test_concurrent_fetches_never_hand_one_task_to_two_workers(engine: Engine, tasks: ExternalTasks) -> None:
    ids = [await engine.client.start(payment, {"order_id": f"o-{n}", "amount": n}) for n in range(60)]
    await engine.run_until_idle()
    fetchers = [ExternalTasks(engine.store, poll_interval=0.05) for _ in range(6)]
    # Every fetcher fetches once before any fetches again, so they overlap whoever gets round trips first
    # (without it one took all 60 tasks alone in one of four runs of `pytest -n 2`, 2026-12-05).
    first_round = asyncio.Barrier(len(fetchers))

    async def drain(n: int) -> list[str]:
        got: list[str] = []
        batch = await fetchers[n].fetch_and_lock(f"w{n}", ["payments"], max_tasks=4)
        await first_round.wait()
        while batch:
            got += [t.id for t in batch]
            batch = await fetchers[n].fetch_and_lock(f"w{n}", ["payments"], max_tasks=4)
        return got

    results = await asyncio.gather(*(drain(n) for n in range(6)))
    handed = [t for r in results for t in r]
    assert len(handed) == len(set(handed)) == len(ids)
    assert sum(1 for r in results if r) > 1  # the fetches did overlap


def first_fetch(tasks: ExternalTasks) -> asyncio.Event:
    """An event set once a fetch of `tasks` has answered: a long poll that found nothing waits then."""
    answered = asyncio.Event()
    fetch = tasks.db.fetch

    async def counted(*args: Any, **kwargs: Any) -> Any:
        out = await fetch(*args, **kwargs)
        answered.set()
        return out

    tasks.db.fetch = counted  # type: ignore[method-assign]
    return answered


async def test_long_polling_wakes_when_a_task_opens(engine: Engine, tasks: ExternalTasks) -> None:
    fetched = first_fetch(tasks)
    poll = asyncio.create_task(tasks.fetch_and_lock("w1", ["payments"], timeout=20))
    await asyncio.wait_for(fetched.wait(), 10)  # its first fetch found nothing: it waits now
    assert not poll.done()
    iid = await _started(engine)
    [task] = await asyncio.wait_for(poll, 10)
    assert task.instance_id == iid
    started = asyncio.get_running_loop().time()
    assert await tasks.fetch_and_lock("w1", ["payments"], timeout=0.3) == []
    assert asyncio.get_running_loop().time() - started >= 0.3
    await tasks.close()


async def test_tasks_inside_branches(engine: Engine, tasks: ExternalTasks) -> None:
    iid = await engine.client.start(shipping, {})
    await engine.run_until_idle()
    locked = await tasks.fetch_and_lock("w1", ["labels"], max_tasks=10)
    assert sorted(t.position for t in locked) == ["each/0", "each/1", "each/2"]
    for t in locked[:2]:
        await tasks.complete(t.id, t.lock_token, {"labels": {t.position.replace("/", "_"): f"L-{t.position}"}})
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "WAITING"
    last = locked[2]
    await tasks.complete(last.id, last.lock_token, {"labels_last": "L-last"})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["done"] is True


async def test_variables_that_do_not_fit_the_state_model_fail_the_position(
    engine: Engine, tasks: ExternalTasks
) -> None:
    iid = await engine.client.start(shipping, {"parcels": ["p1"]})
    await engine.run_until_idle()
    [task] = await tasks.fetch_and_lock("w1", ["labels"])
    await tasks.complete(task.id, task.lock_token, {"done": "not a boolean"})  # Parcels.done is a bool
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED" and info.error["type"] == "InvalidVariables"
    assert info.state["done"] is False  # nothing of them was stored
    await engine.client.retry(iid)  # the operator: the task is open again
    await engine.run_until_idle()
    [task] = await tasks.fetch_and_lock("w1", ["labels"])
    await tasks.complete(task.id, task.lock_token, {"labels": {"p1": "L-1"}})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["labels"] == {"p1": "L-1"}


async def test_a_purged_instance_takes_its_external_task_with_it(engine: Engine, tasks: ExternalTasks) -> None:
    """Retention's purge left the task row (its payload, the worker's last error) for ever."""
    iid = await _started(engine)
    task = await _one(tasks)
    await tasks.complete(task.id, task.lock_token, {"charge_id": "ch-1"})
    await engine.run_until_idle()
    ops = Operations.on(engine.store, actor="oncall")
    await engine.move_clock(31 * 86_400)
    assert (await ops.retention_run()).archived == 1
    await engine.move_clock(2 * 86_400)
    assert (await ops.retention_run()).purged == 1
    assert await tasks.list(instance_id=iid) == []


async def test_a_long_poll_cancelled_as_it_is_woken_locks_nothing(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    # The notification and the cancellation in one loop iteration: on Python 3.11, asyncio.wait_for lost the
    # cancellation there, and the cancelled poll fetched again and locked the task for nobody.
    tasks = ExternalTasks(engine.store, poll_interval=60)

    async def not_listening() -> None:
        pass  # only the test wakes the poll

    monkeypatch.setattr(tasks, "_listen", not_listening)
    fetched = first_fetch(tasks)
    poll = asyncio.create_task(tasks.fetch_and_lock("w1", ["payments"], timeout=20))
    await asyncio.wait_for(fetched.wait(), 10)  # its first fetch found nothing: it waits now
    iid = await _started(engine)
    tasks._wake()  # as the task's notification would
    poll.cancel()
    with pytest.raises(asyncio.CancelledError):
        await poll
    task = await _one(tasks, "w2")  # not locked by the cancelled poll
    assert task.instance_id == iid
