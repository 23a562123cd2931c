"""A commit whose outcome is unknown (the connection died around it) is settled by re-reading, never by
guessing: runtime/committer.commit_fenced re-reads the claim and either reports the commit that did
happen, commits again when it did not and the claim still holds, or gives up when another worker holds
the instance now.

The store is wrapped in test code to lose the acknowledgement (after the real commit) or the request
(before it); the restart and cut-connection chaos scenarios do the same for real.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.errors import DatabaseUnavailable
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.postgres import PostgresStore
from stepstone.testing import open_engine

wf: Workflow[Any] = Workflow("unknown-outcome", version=1)
runs: list[str] = []


@wf.step(start=True, next="b")
def a(ctx: StepContext, state: dict[str, Any]) -> None:
    runs.append(ctx.idempotency_key)


@wf.step(next=None)
def b(ctx: StepContext, state: dict[str, Any]) -> None:
    runs.append(ctx.idempotency_key)
    ctx.emit("done", {})


timed: Workflow[Any] = Workflow("unknown-outcome-timed", version=1)


@timed.step(start=True, next="nap")
def first(ctx: StepContext, state: dict[str, Any]) -> None:
    runs.append(ctx.idempotency_key)


timed.timer("nap", delay=timedelta(minutes=5), next="last")


@timed.step(next=None)
def last(ctx: StepContext, state: dict[str, Any]) -> None:
    runs.append(ctx.idempotency_key)


registry = Registry(wf, timed)


class LossyStore:
    """Delegates to the real store; the n-th commit loses its request or its acknowledgement."""

    def __init__(self, store: PostgresStore, nth: int, where: str, before_raise: Any = None) -> None:
        self._store = store
        self._n = 0
        self.nth, self.where, self.before_raise = nth, where, before_raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def commit(self, *args: Any, **kwargs: Any) -> Any:
        self._n += 1
        if self._n != self.nth:
            return await self._store.commit(*args, **kwargs)
        if self.where == "ack":
            await self._store.commit(*args, **kwargs)
        if self.before_raise is not None:
            await self.before_raise(self._store)
        raise DatabaseUnavailable("connection lost (test)", host="test", port=None)


async def _run(
    database_url: str, nth: int, where: str, before_raise: Any = None, workflow: Workflow[Any] = wf
) -> tuple[Any, Worker]:
    runs.clear()
    async with open_engine(database_url, registry) as engine:
        lossy = LossyStore(engine.store, nth, where, before_raise)
        worker = Worker(lossy, registry, WorkerConfig(concurrency=1, lease_seconds=5))  # type: ignore[arg-type]
        iid = await engine.client.start(workflow, {})
        await worker.run_until_idle()
        info = await engine.client.get(iid)
        kinds = [h["kind"] for h in await engine.client.history(iid)]
        outbox = await engine.store.pool.fetchval("SELECT count(*) FROM stepstone.outbox")
        return (info.status, kinds, outbox), worker


EXPECTED = ["INSTANCE_STARTED", "STEP_COMPLETED", "STEP_COMPLETED", "INSTANCE_COMPLETED"]


@pytest.mark.parametrize("nth", [1, 2], ids=["with-continuation", "last-step"])
@pytest.mark.parametrize("where", ["ack", "request"])
async def test_unknown_outcome_is_settled_by_rereading(database_url: str, nth: int, where: str) -> None:
    (status, kinds, outbox), worker = await _run(database_url, nth, where)
    assert status == "COMPLETED"
    assert kinds == EXPECTED  # each step committed exactly once, whichever way the commit was lost
    assert outbox == 1
    assert len(runs) == 2  # no handler ran again: the re-read settled it
    assert worker.events.fenced == 0


async def test_unknown_outcome_after_a_takeover_is_fenced(database_url: str) -> None:
    """The request was lost and meanwhile the lease expired and another worker claimed the instance."""

    async def takeover(store: PostgresStore) -> None:
        await store.move_clock(6)
        claims = await store.claim(1, 5, "other-worker")
        assert len(claims) == 1

    (status, kinds, _), worker = await _run(database_url, 1, "request", takeover)
    assert worker.events.fenced == 1
    assert status == "PENDING"  # still where it was: the other worker now holds it
    assert kinds == ["INSTANCE_STARTED"]  # the zombie's commit wrote nothing


async def test_unknown_outcome_of_a_step_that_entered_a_timed_wait(database_url: str) -> None:
    """The acknowledgement of a commit that turned the claimed command into the wait's timer (migration
    0035) was lost: the re-read finds the claim's token on the timer and reports the commit, so the
    worker neither runs the step again nor counts itself fenced."""
    (status, kinds, _), worker = await _run(database_url, 1, "ack", workflow=timed)
    assert status == "WAITING"
    assert kinds == ["INSTANCE_STARTED", "STEP_COMPLETED", "WAITING"]
    assert len(runs) == 1
    assert worker.events.fenced == 0


class LossyRereads(LossyStore):
    """Loses the nth commit's acknowledgement (after the real commit), or its request, then one call of each
    named read the worker makes to learn what became of it."""

    def __init__(self, store: PostgresStore, nth: int, reads: list[str], before_raise: Any = None) -> None:
        super().__init__(store, nth, "ack" if before_raise is None else "request", before_raise)
        self.failing = set(reads)

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._store, name)
        if name not in self.failing:
            return real

        async def once(*args: Any, **kwargs: Any) -> Any:
            self.failing.discard(name)
            raise DatabaseUnavailable("connection lost while re-reading (test)", host="test", port=None)

        return once


@pytest.mark.parametrize(("workflow", "nth", "reads", "status"), [
    (timed, 1, ["held_command"], "WAITING"),  # the commit turned the claim into the wait's timer: db_now
    (timed, 1, ["db_now"], "WAITING"),
    (wf, 2, ["settled_by"], "COMPLETED"),  # the last step's commit: settled_by, then db_now
    (wf, 2, ["held_command", "settled_by", "db_now"], "COMPLETED"),
], ids=["held_command", "db_now", "settled_by", "all-three"])
async def test_a_reread_that_loses_its_connection_is_asked_again(
    database_url: str, workflow: Workflow[Any], nth: int, reads: list[str], status: str,
) -> None:
    """The reads that settle an unknown outcome can meet the same cut: only the first was asked again, and
    a cut under `settled_by` or `db_now` crashed the segment. Under load (the chaos rig's cuts) the lease
    then expired, another worker ran the step again, and nothing said the first had been fenced: three
    repeated effects the rig could not explain."""
    runs.clear()
    async with open_engine(database_url, registry) as engine:
        lossy = LossyRereads(engine.store, nth, reads)
        worker = Worker(lossy, registry, WorkerConfig(concurrency=1, lease_seconds=5))  # type: ignore[arg-type]
        iid = await engine.client.start(workflow, {})
        await worker.run_until_idle()
        assert lossy.failing == set()  # every read named met its cut
        assert (worker.events.crashed, worker.events.fenced) == (0, 0)
        assert (await engine.client.get(iid)).status == status
        assert len(runs) == nth  # no handler ran again


async def test_a_fenced_outcome_is_told_when_its_reread_loses_its_connection(database_url: str) -> None:
    """The request was lost, another worker took the instance over, and the re-read's `settled_by` met a cut:
    the worker still learns it was fenced, instead of crashing with nothing said."""

    async def takeover(store: PostgresStore) -> None:
        await store.move_clock(6)
        assert len(await store.claim(1, 5, "other-worker")) == 1

    runs.clear()
    async with open_engine(database_url, registry) as engine:
        lossy = LossyRereads(engine.store, 1, ["settled_by"], takeover)
        worker = Worker(lossy, registry, WorkerConfig(concurrency=1, lease_seconds=5))  # type: ignore[arg-type]
        await engine.client.start(wf, {})
        await worker.run_until_idle()
        assert lossy.failing == set()
        assert (worker.events.crashed, worker.events.fenced) == (0, 1)
