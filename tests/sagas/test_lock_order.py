"""Lock order on the saga paths: compensation commits, cancels (with and without compensation), an
instance deadline firing and children completing into a parent that compensates, all at once on real
connections, in opposite orders. No deadlock (SQLSTATE 40P01) in any caller's exceptions, in any
commit of the workers (group commits included), nor in PostgreSQL's count for the database; and every
instance still ends.

A group commit (several segments in one transaction, each locking its own instance) holds the locks
of its earlier segments while a later one waits; with a child's commit in it and its parent's after,
it closed a cycle with a cancel of the parent (which takes the parent, then the child). A child's
commit now goes alone (committer.py); the second test makes that cycle on purpose."""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from typing import Any

import asyncpg
from pydantic import BaseModel

from stepstone.authoring.workflow import CompensationContext, Registry, Retry, StepContext, Workflow
from stepstone.client import Client
from stepstone.core.model import Decision
from stepstone.core.transitions import apply, child_id
from stepstone.errors import InstanceNotFound, InvalidState
from stepstone.runtime.committer import GroupCommitter
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.port import CommitRequest
from stepstone.store.postgres import PostgresStore
from stepstone.testing import open_engine
from tests._pg import until_blocked

INSTANCES = 12
DEADLINE = 60


class Held(BaseModel):
    undone: list[str] = []


def _undo(ctx: CompensationContext, state: Held, recorded: Any) -> None:
    state.undone.append(ctx.step)


QUICK = Retry(max_attempts=3, backoff=0)

# The child: one compensable step, then a wait the test ends with "go" (the child completes).
lo_child: Workflow[Held] = Workflow("lo-child", version=1, state=Held)


@lo_child.step(start=True, next="c_wait")
def c_one(ctx: StepContext, state: Held) -> None:
    ctx.record("c")


lo_child.compensation("c_one", retry=QUICK)(_undo)
lo_child.wait("c_wait", signals={"go": "c_done"})


@lo_child.step(next=None)
def c_done(ctx: StepContext, state: Held) -> None:
    ctx.record("done")


lo_child.compensation("c_done", retry=QUICK)(_undo)

# The parent: a compensable step, the child, another compensable step, then a wait only the deadline ends.
lo_parent: Workflow[Held] = Workflow("lo-parent", version=1, state=Held, deadline=DEADLINE)


@lo_parent.step(start=True, next="kid")
def p_one(ctx: StepContext, state: Held) -> None:
    ctx.record("p")


@lo_parent.child(workflow="lo-child", next="p_two")
def kid(ctx: StepContext, state: Held) -> dict[str, Any]:
    return {}


@lo_parent.step(next="p_wait")
def p_two(ctx: StepContext, state: Held) -> None:
    ctx.record("p2")


lo_parent.wait("p_wait", signals={"never": "p_two"})
for _name in ("p_one", "p_two"):
    lo_parent.compensation(_name, retry=QUICK)(_undo)

registry = Registry(lo_child, lo_parent)


class _Deadlocks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []
        self.group_fallbacks = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage() + (str(record.exc_info[1]) if record.exc_info else "")
        if text.startswith("group commit of") and "DeadlockDetectedError" in text:
            self.group_fallbacks += 1  # aborted whole, then committed one by one (see the docstring)
        elif "deadlock" in text.lower() or "40P01" in text:
            self.seen.append(text[:300])


async def _deadlocks(conn: asyncpg.Connection) -> int:
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    value: int = await conn.fetchval("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
    return value


async def test_saga_paths_take_locks_in_one_order(database_url: str, conn: asyncpg.Connection) -> None:
    handler = _Deadlocks()
    logging.getLogger("stepstone").addHandler(handler)
    errors: list[str] = []
    stores: list[PostgresStore] = []
    try:
        async with open_engine(database_url, registry, concurrency=4, lease_seconds=30) as engine:
            parents = [await engine.client.start(lo_parent, {}) for _ in range(INSTANCES)]
            await engine.run_until_idle()  # every parent waits for its child, every child for "go"
            children = {iid: child_id(iid, "", "kid", 2) for iid in parents}
            for cid in children.values():
                assert (await engine.client.get(cid)).step == "c_wait"
            deadlocks_before = await _deadlocks(conn)

            stores.extend([await PostgresStore.open(database_url, max_size=4) for _ in range(5)])
            workers = [Worker(stores[n], registry, WorkerConfig(concurrency=4, lease_seconds=30, poll_interval=0.05))
                       for n in range(2)]
            for worker in workers:
                await worker.start()

            async def guarded(coro: Any) -> None:
                try:
                    await coro
                except (InvalidState, InstanceNotFound):
                    pass  # a refusal (the instance ended meanwhile) is an answer, not a lock problem
                except Exception as exc:  # noqa: BLE001 - everything else is reported, not swallowed
                    errors.append(f"{type(exc).__name__}: {exc}")

            async def actor(store: PostgresStore, order: list[str], seed: int) -> None:
                c = Client(store, registry)
                rng = random.Random(seed)  # noqa: S311 - a reproducible schedule
                for iid in order:
                    n = parents.index(iid)
                    moves = [c.signal(children[iid], "go")]
                    if n % 3 != 2:  # every third parent is left to its deadline
                        moves.append(c.cancel(iid, "lock order", compensate=n % 3 == 0))
                    rng.shuffle(moves)
                    for move in moves:
                        await guarded(move)

            async def clock() -> None:
                await asyncio.sleep(0)  # let the others begin: the deadline fires among them
                await stores[4].move_clock(DEADLINE + 1)

            # Children complete into parents that compensate or are cancelled; compensations commit;
            # deadlines fire on the rest, everything on the parents and children both ways round.
            await asyncio.gather(actor(stores[2], parents, 1), actor(stores[3], parents[::-1], 2), clock())
            async with Client(stores[4], registry) as watcher:
                ended = [await watcher.wait_for(iid, timeout=60) for iid in parents]
            for worker in workers:
                await worker.stop(drain_timeout=5)
    finally:
        logging.getLogger("stepstone").removeHandler(handler)
        for store in stores:
            await store.close()

    assert errors == [], errors[:10]
    assert handler.seen == [], handler.seen[:10]
    statuses = [info.status for info in ended]
    assert all(s == "TIMED_OUT" for s in statuses[2::3]), statuses
    assert set(statuses) <= {"CANCELLED", "TIMED_OUT"}, statuses
    # Nothing was compensated twice (a second commit of one compensation is refused and would show here).
    rows = await conn.fetch("SELECT status, attempts FROM stepstone.compensations")
    assert {(r["status"], r["attempts"]) for r in rows} <= {("COMPENSATED", 1), ("PENDING", 0)}, rows
    assert sum(r["status"] == "COMPENSATED" for r in rows) >= 2 * (INSTANCES // 3), rows  # the deadlines' at least
    assert handler.group_fallbacks == 0
    assert await _deadlocks(conn) == deadlocks_before


async def test_a_group_never_holds_a_child_while_it_waits_for_its_parent(
    database_url: str, conn: asyncpg.Connection,
) -> None:
    """The cycle the group commit could close, made on purpose: a transaction holds a parent's row (as a
    cancel does, which then takes the children), a worker's commits of that parent and of its child go
    to the committer together, the child's id sorting first; the transaction then takes the child. A
    group [child, parent] would hold the child while it waits for the parent: a deadlock. The child's
    commit goes alone (committer.py), so none happens and every commit lands."""
    async with open_engine(database_url, registry, concurrency=4, lease_seconds=30) as engine:
        while True:  # a parent whose child's id sorts before its own, as a group orders them
            pid = await engine.client.start(lo_parent, {})
            await engine.run_until_idle()
            cid = child_id(pid, "", "kid", 2)
            if cid < pid:
                break
            await engine.client.cancel(pid, "not this one")
            await engine.run_until_idle()
        await engine.client.signal(cid, "go")
        await engine.move_clock(DEADLINE + 1)  # the parent's deadline is due: both have a command to commit
        claims = {c.instance.id: c for c in await engine.store.claim(8, 30, "grouper")}
        assert set(claims) == {pid, cid}, claims
        requests = []
        for iid, wf in ((cid, lo_child), (pid, lo_parent)):
            claim = claims[iid]
            decision = apply(claim.instance, claim.command, wf.plan, claim.now)
            assert isinstance(decision, Decision), decision
            requests.append(CommitRequest(claim, claim.command.id, decision, claim.instance.visit,
                                          claim.instance.state_version))
        deadlocks_before = await _deadlocks(conn)
        holder = await asyncpg.connect(database_url)
        try:
            held = holder.transaction()
            await held.start()
            await holder.execute("SELECT 1 FROM stepstone.instances WHERE id = $1 FOR UPDATE", uuid.UUID(pid))
            committer = GroupCommitter(engine.store, lease_seconds=30, worker="grouper")
            both = asyncio.gather(*(committer.commit(r) for r in requests))  # queued in one tick: one batch
            # Until a commit waits for the parent's row: PostgreSQL tells no one when a session begins to
            # wait for a lock, so the server is looked at until it shows one.
            await until_blocked(conn, holder, every=0.02, timeout=10,
                                failure="no commit came to wait for the parent's row")
            await holder.execute("SELECT 1 FROM stepstone.instances WHERE id = $1 FOR UPDATE", uuid.UUID(cid))
            await held.commit()
            results = await asyncio.wait_for(both, timeout=30)
        finally:
            await holder.close()
        assert all(r is not None for r in results), results
        assert await _deadlocks(conn) == deadlocks_before
