"""Chaos for human tasks and messages: two workers run while clients claim, reassign, complete and
cancel the same tasks from opposite ends and publishers race the waits for their messages, while one
worker stops mid-way without draining (its in-flight leases expire and the other takes them over).
Nothing deadlocks (no 40P01 anywhere), every task completes at most once and only on an instance
that moved on with it, every message is delivered at most once, and no open task or subscription is
left on an ended instance. Buffered messages go on through the same run: each is taken from the buffer by
a wait that a signal queued before it then wins (or whose instance is cancelled), and is handed on to
another wait of its key, opened before or after, or back to the buffer; each is applied at most once, and
none is lost (applied, buffered, or expired). STEPSTONE_CHAOS_SEED picks another interleaving."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import AsyncIterator
from typing import Any

import asyncpg

from stepstone.errors import StepstoneError
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.testing import open_engine
from tests._pg import until_shown
from tests.engine.task_workflows import Expense, Receipt, expense, receipt, registry

N = 16
HANDED = 8  # keys of the buffered messages that go on (h0..h7): one each, taken by a wait that is left
USERS = ["ann", "ben", "cy", "dee"]


async def test_tasks_and_messages_under_concurrent_operations(database_url: str) -> None:
    rng = random.Random(int(os.environ.get("STEPSTONE_CHAOS_SEED", "11")))  # noqa: S311 - reproducible, not a secret
    errors: list[BaseException] = []

    async def attempt(call: Any) -> None:
        try:
            await call
        except StepstoneError:
            pass  # a refusal is an answer (TaskHeld, TaskNotOpen, ...); anything else is a finding
        except BaseException as exc:  # noqa: BLE001 - collected and asserted on below
            errors.append(exc)

    async with open_engine(database_url, registry, concurrency=4, lease_seconds=2) as engine:
        client = engine.client
        for n in range(N // 4):  # some receipts arrive before anyone waits: buffered
            await client.publish_message("receipt_received", f"k{n}", {"n": n}, ttl=600, message_id=f"early-{n}")
        expenses = [await client.start(expense, Expense(expense_id=f"e{n}", employee="eve", amount=n))
                    for n in range(N)]
        receipts = [await client.start(receipt, Receipt(order_id=f"k{n}")) for n in range(N)]
        leavers: list[str] = []
        takers: list[str] = []
        for n in range(HANDED):  # the leaver's wait takes the message, and the skip sent before it wins
            await client.publish_message("receipt_received", f"h{n}", {"n": n}, ttl=600, message_id=f"hand-{n}")
            leavers.append(await client.start(receipt, Receipt(order_id=f"h{n}")))
            await client.signal(leavers[-1], "skip", {"n": "s"})
        doomed = Worker(engine.store, registry, WorkerConfig(concurrency=2, lease_seconds=2))
        other = engine.new_worker(concurrency=4, lease_seconds=2)
        await doomed.start()
        await other.start()
        try:
            # Stopped mid-way: once it has a step of its own in flight.
            await doomed.events.wait_until(lambda: doomed.events.claims >= 1, timeout=30)
            doomed_task = asyncio.ensure_future(doomed.stop(drain_timeout=0))  # its leases die with it
            async with _connection(database_url) as watcher:  # every leaver's wait took its message
                await until_shown(watcher, _TAKEN, every=0.02, timeout=30, failure="a leaver's wait took nothing")
            # A wait of the key open when (or soon after) the message goes on.
            takers += [await client.start(receipt, Receipt(order_id=f"h{n}")) for n in range(1, HANDED, 2)]
            ops: list[Any] = []
            for n in range(N):
                ops.append(client.publish_message("receipt_received", f"k{n}", {"n": n}, ttl=600))
                ops.append(client.publish_message("receipt_received", f"k{n}", {"n": -n}, ttl=600))
            ops += [client.cancel(iid, "chaos") for iid in leavers[::3]]  # rejected: its message goes on too
            await asyncio.gather(*(attempt(op) for op in ops))
            # A wait of the key opened after its message went on.
            takers += [await client.start(receipt, Receipt(order_id=f"h{n}")) for n in range(0, HANDED, 2)]
            for _ in range(3):
                page = await client.tasks(mode="all", limit=100)
                calls: list[Any] = []
                for task in page.tasks:
                    users = rng.sample(USERS, 3)
                    calls += [client.claim_task(task.id, actor=users[0], groups=["finance"]),
                              client.reassign_task(task.id, users[1], actor=users[0]),
                              client.complete_task(task.id, rng.choice(["approve", "reject"]), {"comment": "c"},
                                                   actor=users[1], groups=["finance"]),
                              client.complete_task(task.id, "reject", None, actor=users[2], groups=["finance"])]
                calls += [client.cancel(iid, "chaos") for iid in rng.sample(expenses, 2)]
                rng.shuffle(calls)
                await asyncio.gather(*(attempt(c) for c in calls))
            await doomed_task
            await _finish_what_chaos_left(client, other, expenses + receipts + leavers + takers, attempt)
            for iid in expenses + receipts + leavers + takers:
                try:
                    await client.wait_for(iid, timeout=30)
                except StepstoneError as exc:
                    errors.append(exc)
        finally:
            await other.stop(drain_timeout=5)
    assert errors == [], errors[:3]
    assert not any("40P01" in repr(e) or "deadlock" in repr(e).lower() for e in errors)

    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT status FROM stepstone.instances")
        assert {r["status"] for r in rows} <= {"COMPLETED", "CANCELLED"}, [r["status"] for r in rows]
        assert await conn.fetchval("""
            SELECT count(*) FROM stepstone.tasks t JOIN stepstone.instances i ON i.id = t.instance_id
            WHERE t.status IN ('OPEN', 'COMPLETING') AND i.status IN ('COMPLETED', 'CANCELLED')""") == 0
        completed_twice = await conn.fetchval("""
            SELECT count(*) FROM (SELECT instance_id, data->>'task_id' FROM stepstone.history
                                  WHERE kind = 'TASK_COMPLETED' GROUP BY 1, 2 HAVING count(*) > 1) AS x""")
        assert completed_twice == 0
        # A COMPLETED task is one whose instance moved on with its decision.
        assert await conn.fetchval("""
            SELECT count(*) FROM stepstone.tasks t WHERE t.status = 'COMPLETED' AND NOT EXISTS (
                SELECT 1 FROM stepstone.history h WHERE h.instance_id = t.instance_id AND h.kind = 'TASK_COMPLETED'
                  AND h.data->>'task_id' = t.id::text)""") == 0
        # Every receipt instance took exactly one message or signal; no message went to two waits.
        taken = await conn.fetch("""
            SELECT instance_id, count(*) AS n FROM stepstone.history
            WHERE kind IN ('MESSAGE_CORRELATED', 'SIGNAL_APPLIED') GROUP BY 1""")
        assert all(r["n"] == 1 for r in taken), taken
        assert await conn.fetchval("""
            SELECT count(*) FROM stepstone.messages WHERE jsonb_array_length(deliveries) > 1""") == 0
        assert await conn.fetchval("""
            SELECT count(*) FROM stepstone.subscriptions s JOIN stepstone.positions p
              ON p.instance_id = s.instance_id AND p.path = s.position
            WHERE s.status = 'OPEN' AND p.status IN ('COMPLETED', 'CANCELLED') AND s.visit = p.visit""") == 0
        # Each handed-on message applied at most once, and none lost: applied (one MESSAGE_CORRELATED naming
        # it, its row DELIVERED), or its row BUFFERED or EXPIRED with none.
        handed = await conn.fetch("""
            SELECT m.message_id, m.status, (SELECT count(*) FROM stepstone.history h
                                            WHERE h.kind = 'MESSAGE_CORRELATED'
                                              AND h.data->>'message_id' = m.message_id) AS applied
            FROM stepstone.messages m WHERE m.message_id LIKE 'hand-%' ORDER BY m.message_id""")
        assert len(handed) == HANDED, handed
        assert all((r["status"], r["applied"]) in {("DELIVERED", 1), ("BUFFERED", 0), ("EXPIRED", 0)}
                   for r in handed), handed
        returned = await conn.fetchval("""
            SELECT count(*) FROM stepstone.commands WHERE kind = 'MESSAGE' AND payload->>'message_id' LIKE 'hand-%'
              AND state IN ('STALE', 'REJECTED')""")
        assert returned >= HANDED, returned  # each message went through the hand-on at least once
        print(f"handed-on messages: {[(r['message_id'], r['status']) for r in handed]}, {returned} returned")  # noqa: T201
    finally:
        await conn.close()


# Every leaver's wait took its message from the buffer: a MESSAGE command for each (behind its skip).
_TAKEN = (f"SELECT count(DISTINCT payload->>'message_id') = {HANDED} FROM stepstone.commands "
          "WHERE kind = 'MESSAGE' AND payload->>'message_id' LIKE 'hand-%'")


@contextlib.asynccontextmanager
async def _connection(url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(url)
    try:
        yield conn
    finally:
        await conn.close()


async def _finish_what_chaos_left(client: Any, worker: Worker, instances: list[str], attempt: Any) -> None:
    """Complete the tasks and skip the receipt waits the chaos left open, until every instance ended.
    In rounds: a step the stopped worker held reaches its task or wait only once its lease expired and
    `worker` (the only one left) took it over, so each round after the first waits for its next commit."""
    open_, skipped = set(instances), set()
    deadline = asyncio.get_running_loop().time() + 60
    while open_:
        commits = worker.events.commits  # before the reads: a commit from here on starts another round
        for task in (await client.tasks(mode="all", limit=100)).tasks:
            await attempt(client.complete_task(task.id, "reject", None, actor="admin", admin=True))
        for iid in sorted(open_):
            info = await client.get(iid)
            if info.status in ("COMPLETED", "CANCELLED", "FAILED"):
                open_.discard(iid)
            elif info.status == "WAITING" and info.step == "await_receipt" and iid not in skipped:
                skipped.add(iid)
                await attempt(client.signal(iid, "skip", {"n": "s"}))
        remaining = deadline - asyncio.get_running_loop().time()
        if not open_ or remaining <= 0:
            return  # what is still open fails the waits that follow
        with contextlib.suppress(TimeoutError):
            await worker.events.wait_until(lambda seen=commits: worker.events.commits > seen, timeout=remaining)
