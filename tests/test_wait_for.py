"""`Client.wait_for` wakes on the notification an instance sends when it settles, not on a poll."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from stepstone.errors import InstanceNotFound, WaitTimeout
from stepstone.store.settled import SettledWatch
from stepstone.testing import Engine, open_engine
from tests import cli_apps


@pytest.fixture
async def engine(database_url: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Engine]:
    # No re-read for a minute and no sleeping at all: only the notification can end a wait in time.
    monkeypatch.setattr(SettledWatch, "fallback_seconds", 60.0)

    async def no_sleep(*_: Any) -> None:
        raise AssertionError("wait_for must not poll with asyncio.sleep")

    monkeypatch.setattr("stepstone.client.asyncio.sleep", no_sleep)
    async with open_engine(database_url, cli_apps.registry) as engine:
        yield engine
        await engine.client.close()


def count_status_reads(engine: Engine, monkeypatch: pytest.MonkeyPatch, waiting_after: int) -> tuple[
        list[str], asyncio.Event]:
    reads: list[str] = []
    waiting = asyncio.Event()
    real = engine.store.status

    async def status(instance_id: str) -> str:
        value = await real(instance_id)
        reads.append(value)
        if len(reads) == waiting_after:
            waiting.set()
        return value

    monkeypatch.setattr(engine.store, "status", status)
    return reads, waiting


async def until_waiting(waiting: asyncio.Event, waiter: asyncio.Task[Any]) -> None:
    """Until the waiter has read twice (so it listens and waits); its own error if it died first."""
    reached = asyncio.ensure_future(waiting.wait())
    try:
        done, _ = await asyncio.wait({reached, waiter}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
    finally:
        reached.cancel()
    if waiter in done:
        waiter.result()
    assert waiting.is_set(), "the waiter never read the status a second time"


async def test_a_wait_ends_on_the_settle_notification(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    client = engine.client
    instance_id = await client.start("approval")
    await engine.run_until_idle()
    reads, waiting = count_status_reads(engine, monkeypatch, waiting_after=2)
    waiter = asyncio.create_task(client.wait_for(instance_id, timeout=30))
    await until_waiting(waiting, waiter)  # read once, listening, and read again: now it waits
    others = [await client.start("hello", {"name": str(n)}) for n in range(3)]
    await engine.run_until_idle()  # three other instances settle and notify: not this waiter's business
    assert [(await client.get(o)).status for o in others] == ["COMPLETED"] * 3
    assert reads == ["WAITING", "WAITING"]
    await client.signal(instance_id, "approve", {"by": "eve"})
    await engine.run_until_idle()
    info = await asyncio.wait_for(waiter, timeout=20)
    assert info.status == "COMPLETED"
    assert reads == ["WAITING", "WAITING", "COMPLETED"]


async def test_cancel_and_failure_wake_a_waiter(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    client = engine.client
    instance_id = await client.start("approval")
    _, waiting = count_status_reads(engine, monkeypatch, waiting_after=2)
    waiter = asyncio.create_task(client.wait_for(instance_id, timeout=30))
    await until_waiting(waiting, waiter)
    assert await client.cancel(instance_id, "not needed") == "CANCELLED"
    assert (await asyncio.wait_for(waiter, timeout=20)).status == "CANCELLED"


async def test_several_waiters_share_one_listener(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    client = engine.client
    ids = [await client.start("hello", {"name": str(n)}) for n in range(3)]
    all_watching, watch = asyncio.Event(), client._settled.watch

    async def counted_watch(instance_id: str) -> asyncio.Event:
        event = await watch(instance_id)
        if sum(len(events) for events in client._settled.waiters.values()) == 2 * len(ids):
            all_watching.set()
        return event

    monkeypatch.setattr(client._settled, "watch", counted_watch)
    waiters = [asyncio.create_task(client.wait_for(i, timeout=30)) for i in ids * 2]
    # Every waiter watches before the worker runs: a waiter that first reads its instance already settled
    # opens nothing, and a fast enough worker left no waiter to share the listener (a flaky failure).
    await asyncio.wait_for(all_watching.wait(), timeout=20)
    await engine.run_until_idle()
    infos = await asyncio.wait_for(asyncio.gather(*waiters), timeout=20)
    assert {i.status for i in infos} == {"COMPLETED"}
    assert client._settled.waiters == {}
    listener = client._settled.listener
    assert listener is not None and listener.alive


async def test_settled_and_missing_instances_need_no_wait(engine: Engine) -> None:
    client = engine.client
    instance_id = await client.start("hello", {"name": "ada"})
    await engine.run_until_idle()
    assert (await client.wait_for(instance_id, timeout=0)).status == "COMPLETED"
    assert client._settled.listener is None  # settled already: nothing was opened
    with pytest.raises(InstanceNotFound):
        await client.wait_for("00000000-0000-0000-0000-000000000000")


async def test_a_wait_times_out_with_the_status(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SettledWatch, "fallback_seconds", 0.01)
    instance_id = await engine.client.start("approval")
    await engine.run_until_idle()
    with pytest.raises(WaitTimeout) as caught:
        await engine.client.wait_for(instance_id, timeout=0.05)
    assert caught.value.status == "WAITING"


async def test_waits_cancelled_while_the_listener_connects_leave_no_waiter(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    client, count = engine.client, 5
    instance_id = await client.start("approval")
    await engine.run_until_idle()
    connecting, never = asyncio.Event(), asyncio.Event()

    async def listen_settled(*_: Any) -> Any:
        connecting.set()
        await never.wait()  # a connect that does not end before the waits are cancelled

    monkeypatch.setattr(engine.store, "listen_settled", listen_settled)
    _, waiting = count_status_reads(engine, monkeypatch, waiting_after=count)
    waits = [asyncio.create_task(client.wait_for(instance_id, timeout=30)) for _ in range(count)]
    # Each wait watches right after its first read: one is in the connect, the others queue behind it.
    await asyncio.wait_for(waiting.wait(), timeout=20)
    assert connecting.is_set()
    assert sum(len(events) for events in client._settled.waiters.values()) == count
    for wait in waits:
        wait.cancel()
    outcomes = await asyncio.gather(*waits, return_exceptions=True)
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
    assert client._settled.waiters == {}
    assert client._settled.listener is None


async def test_a_wait_cancelled_as_its_instance_settles_is_cancelled(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    # The settle notification and the cancellation in one loop iteration: on Python 3.11, asyncio.wait_for
    # lost the cancellation there, and the cancelled wait read the status again and waited on.
    instance_id = await engine.client.start("approval")
    await engine.run_until_idle()
    reads, waiting = count_status_reads(engine, monkeypatch, waiting_after=2)
    waiter = asyncio.create_task(engine.client.wait_for(instance_id, timeout=30))
    await until_waiting(waiting, waiter)
    engine.client._settled._notified(instance_id)  # as the notification would
    waiter.cancel()
    done, _ = await asyncio.wait({waiter}, timeout=20)
    assert waiter in done and waiter.cancelled(), f"the wait ran on after its cancellation, reading {reads}"
    assert reads == ["WAITING", "WAITING"]
