"""Dead-lettered commands that carry a result found nowhere else, and the retry of their instance, against
real PostgreSQL.

A command that crashes its workers until its attempts run out is dead-lettered (DEAD) and fails its position
and the instance; the position keeps its wait. A branch's report to its join, an external task's completion,
a child's report and a human task's completion each carry what the instance would go on with: the retry must
neither lose it (the instance waiting for ever) nor have its work done again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.core.model import Decision
from stepstone.core.transitions import apply
from stepstone.external import ExternalTasks
from stepstone.store.port import CommitRequest
from stepstone.testing import Engine, open_engine
from tests.crashes import die_alone
from tests.engine.branch_workflows import Job, job, strict_parent
from tests.engine.conftest import kinds
from tests.engine.task_workflows import Expense, expense
from tests.external.workflows import payment

RUNS: dict[str, int] = {}
"""How many times each branch step's handler ran."""

# Three branches: `a` runs a step, `b` and `c` wait for the signal `go`, which takes them to the join.
forked = Workflow("dead_fork", version=1)
forked.fork("split", branches={"a": "quick", "b": "hold", "c": "hold"}, start=True)


@forked.step(next="met")
async def quick(ctx: StepContext, state: dict[str, Any]) -> None:
    RUNS["quick"] = RUNS.get("quick", 0) + 1


forked.wait("hold", signals={"go": "met"})
forked.join("met", fork="split", next="after")


@forked.step(next=None)
async def after(ctx: StepContext, state: dict[str, Any]) -> None:
    state["after"] = True


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    RUNS.clear()
    registry = Registry(forked, payment, job, strict_parent, expense)
    async with open_engine(database_url, registry, concurrency=2, max_claims=3) as e:
        yield e


async def _commit_one(engine: Engine, workflow: Workflow[Any]) -> None:
    """Claim the one claimable command and commit it as a worker would (it runs no handler)."""
    [claim] = await engine.store.claim(1, 30, "w")
    decision = apply(claim.instance, claim.command, workflow.plan, claim.now)
    assert isinstance(decision, Decision), decision
    assert await engine.store.commit(CommitRequest(claim, claim.command.id, decision, claim.instance.visit,
                                                   claim.instance.state_version), lease_seconds=30, worker="w")


async def _reports(conn: asyncpg.Connection, iid: str) -> list[tuple[str, str]]:
    rows = await conn.fetch("SELECT payload->>'branch' AS branch, state FROM stepstone.commands "
                            "WHERE instance_id = $1::uuid AND kind = 'BRANCH_DONE' ORDER BY id", iid)
    return [(r["branch"], r["state"]) for r in rows]


async def _join_failed_at_bs_report(engine: Engine) -> str:
    """`a` joined; `b`'s report dead-lettered at the join: the fork's position (the root) FAILED with its
    join's count kept, the instance FAILED; `c` still waits."""
    c = engine.client
    iid = await c.start(forked, {})
    await engine.run_until_idle()
    await c.signal(iid, "go", position="split/b")
    await _commit_one(engine, forked)  # b reaches the join: its report is queued on the root
    assert {claim.command.kind for claim in await die_alone(engine)} == {"BRANCH_DONE"}
    await engine.run_until_idle()
    info = await c.get(iid)
    assert info.status == "FAILED" and info.error is not None and info.error["type"] == "DeadLetter"
    [root] = [p for p in info.positions if p["path"] == ""]
    assert (root["status"], root["wait"]["done"]) == ("FAILED", 1)
    return iid


async def test_a_report_reaching_a_failed_join_waits_for_the_retry(engine: Engine, conn: asyncpg.Connection) -> None:
    """Another branch's report reaching the join after it failed at a dead report was counted there: the
    failed position was set WAITING again, and the instance with it (its error kept), with the dead report
    never counted, so the join waited for ever and the retry was refused (not FAILED). It is parked."""
    c = engine.client
    iid = await _join_failed_at_bs_report(engine)
    await c.signal(iid, "go", position="split/c")
    await engine.run_until_idle()
    info = await c.get(iid)
    [root] = [p for p in info.positions if p["path"] == ""]
    assert (info.status, root["status"], root["wait"]["done"]) == ("FAILED", "FAILED", 1)
    assert await _reports(conn, iid) == [("split/a", "COMPLETE"), ("split/b", "DEAD"), ("split/c", "PARKED")]
    assert kinds(await c.history(iid))[-1] == "BRANCH_PARKED"


async def test_a_report_parked_at_a_failed_join_is_no_parked_signal(engine: Engine) -> None:
    """The instance's `parked_signals` counted every PARKED command, so c's report parked at the failed join
    was shown (Client.get, the API, `stepstone show`) as a parked signal the instance held. It counts the
    signals and messages parked with it: a signal to the failed join's position is one."""
    c = engine.client
    iid = await _join_failed_at_bs_report(engine)
    await c.signal(iid, "go", position="split/c")
    await engine.run_until_idle()
    assert (await c.get(iid)).parked_signals == 0
    await c.signal(iid, "go")  # the root, failed at the join, takes no signal: parked on it
    await engine.run_until_idle()
    assert (await c.get(iid)).parked_signals == 1


async def test_a_dead_lettered_branch_report_is_counted_once_after_the_retry(
    engine: Engine, conn: asyncpg.Connection,
) -> None:
    """The retry forked again: `a` ran its step a second time and `b`, which had taken its signal, waited for
    it again (for ever, unless sent again). The join waits again with its count, and b's dead report is
    counted there once: no branch runs again."""
    c = engine.client
    iid = await _join_failed_at_bs_report(engine)
    await c.retry(iid)
    await engine.run_until_idle()
    await c.signal(iid, "go", position="split/c")
    await engine.run_until_idle()
    info = await c.get(iid)
    assert (info.status, RUNS) == ("COMPLETED", {"quick": 1}), info
    assert info.state == {"after": True}
    assert await _reports(conn, iid) == [("split/a", "COMPLETE"), ("split/b", "COMPLETE"), ("split/c", "COMPLETE")]
    history = kinds(await c.history(iid))
    assert (history.count("FORK_STARTED"), history.count("BRANCH_JOINED"), history.count("JOINED")) == (1, 3, 1)


async def test_a_report_parked_at_a_failed_join_is_counted_with_the_dead_one(
    engine: Engine, conn: asyncpg.Connection,
) -> None:
    """c's report, parked at the failed join, is offered again by the retry with b's dead one: the join is
    met, each counted once."""
    c = engine.client
    iid = await _join_failed_at_bs_report(engine)
    await c.signal(iid, "go", position="split/c")
    await engine.run_until_idle()
    await c.retry(iid)
    await engine.run_until_idle()
    info = await c.get(iid)
    assert (info.status, RUNS) == ("COMPLETED", {"quick": 1}), info
    assert await _reports(conn, iid) == [("split/a", "COMPLETE"), ("split/b", "COMPLETE"), ("split/c", "COMPLETE")]
    history = kinds(await c.history(iid))
    assert (history.count("FORK_STARTED"), history.count("BRANCH_JOINED"), history.count("JOINED")) == (1, 3, 1)


async def test_a_dead_lettered_external_completion_is_applied_after_the_retry(
    engine: Engine, conn: asyncpg.Connection,
) -> None:
    """The retry opened the external task again (fresh retries, offered to a worker): the worker's answer
    was lost and its work would be done again. The step waits again for the same task, which stays
    COMPLETED, and the dead answer is applied once: its variables reach the state."""
    c = engine.client
    iid = await c.start(payment, {"order_id": "X-1", "amount": 42})
    await engine.run_until_idle()
    tasks = ExternalTasks(engine.store, poll_interval=0.05)
    try:
        [task] = await tasks.fetch_and_lock("w1", ["payments"])
        answer = await tasks.complete(task.id, task.lock_token, {"charge_id": "ch-1"}, worker_id="w1")
        assert {claim.command.kind for claim in await die_alone(engine)} == {"EXTERNAL_COMPLETION"}
        await engine.run_until_idle()
        info = await c.get(iid)
        assert info.status == "FAILED" and info.error is not None and info.error["type"] == "DeadLetter"
        await c.retry(iid)
        await engine.run_until_idle()
        info = await c.get(iid)
        status = await conn.fetchval("SELECT status FROM stepstone.external_tasks WHERE id = $1::uuid", task.id)
        assert (info.status, status) == ("COMPLETED", "COMPLETED"), info
        assert await tasks.fetch_and_lock("w2", ["payments"]) == []  # never offered again
        assert info.state["receipt"] == "X-1 paid with ch-1"
        [command] = await conn.fetch("SELECT id, state FROM stepstone.commands WHERE instance_id = $1::uuid "
                                     "AND kind = 'EXTERNAL_COMPLETION'", iid)
        assert (command["id"], command["state"]) == (answer.command_id, "COMPLETE")
        history = kinds(await c.history(iid))
        assert (history.count("EXTERNAL_TASK_OPENED"), history.count("EXTERNAL_TASK_COMPLETED")) == (1, 1)
    finally:
        await tasks.close()


async def test_a_dead_lettered_child_report_is_made_again_by_the_retry(
    engine: Engine, conn: asyncpg.Connection,
) -> None:
    """Holds what was found right: the child COMPLETED, its report dead-lettered in the parent (FAILED). The
    retry supersedes the report and runs the parent's child step again, which starts no second child and
    queues the ended child's report again (start_children): the parent goes on with the child's result."""
    c = engine.client
    iid = await c.start(strict_parent, Job(n=3, wait=True))
    await engine.run_until_idle()
    [child] = await conn.fetch("SELECT id::text FROM stepstone.instances WHERE parent_id = $1::uuid", iid)
    await c.signal(child["id"], "done")
    await _commit_one(engine, job)  # the child completes: its report is queued on the parent
    assert (await c.get(child["id"])).status == "COMPLETED"
    assert {claim.command.kind for claim in await die_alone(engine)} == {"CHILD_COMPLETION"}
    await engine.run_until_idle()
    assert (await c.get(iid)).status == "FAILED"
    await c.retry(iid)
    await engine.run_until_idle()
    info = await c.get(iid)
    assert (info.status, info.state["out"]) == ("COMPLETED", 30), info
    assert await conn.fetchval("SELECT count(*) FROM stepstone.instances WHERE parent_id = $1::uuid", iid) == 1
    reports = await conn.fetch("SELECT state FROM stepstone.commands WHERE instance_id = $1::uuid "
                               "AND kind = 'CHILD_COMPLETION' ORDER BY id", iid)
    assert [r["state"] for r in reports] == ["SUPERSEDED", "COMPLETE"]
    history = kinds(await c.history(iid))
    assert (history.count("CHILD_STARTED"), history.count("CHILD_COMPLETED")) == (2, 1)  # the second: no start


async def test_a_dead_lettered_task_completion_gives_the_task_back_once(
    engine: Engine, conn: asyncpg.Connection,
) -> None:
    """The retry gave the task back but entered its step again, which queued its reminder, due date and
    expiry a second time beside the first: the second reminder of the visit crashed its segment on the
    outbox event the first had written. The step waits again with its own timers, the task OPEN, and the
    next completion is applied."""
    c = engine.client
    iid = await c.start(expense, Expense(expense_id="e-dead", employee="eve", amount=12.5))
    await engine.run_until_idle()
    [task] = (await c.tasks(user="alice", groups=["finance"])).tasks
    await c.complete_task(task.id, "approve", {"comment": "fine"}, actor="alice", groups=["finance"])
    assert {claim.command.kind for claim in await die_alone(engine)} == {"TASK_COMPLETION"}
    await engine.run_until_idle()
    assert (await c.get(iid)).status == "FAILED"
    assert (await c.task(task.id)).status == "COMPLETING"
    await c.retry(iid)
    await engine.run_until_idle()
    assert ((await c.get(iid)).status, (await c.task(task.id)).status) == ("WAITING", "OPEN")
    pending = await conn.fetchval("SELECT count(*) FROM stepstone.commands WHERE instance_id = $1::uuid "
                                  "AND kind = 'TIMER' AND name = 'remind' AND state = 'PENDING'", iid)
    assert pending == 1
    await engine.move_clock(timedelta(hours=4, minutes=1))  # the reminder and the due date fire
    await engine.run_until_idle()
    crashed = await conn.fetch("SELECT id, name, last_error FROM stepstone.commands WHERE instance_id = $1::uuid "
                               "AND last_error LIKE 'segment crashed%'", iid)
    assert crashed == []
    await c.complete_task(task.id, "reject", None, actor="bob", groups=["finance", "finance-leads"])
    await engine.run_until_idle()
    info = await c.get(iid)
    assert (info.status, info.state["outcome"], info.state["decided_by"]) == ("COMPLETED", "REJECTED", "bob")
    history = await c.history(iid)
    counted = kinds(history)
    assert [counted.count(k) for k in ("TASK_OPENED", "TASK_REMINDED", "TASK_ESCALATED")] == [1, 1, 1]
    [refused] = [e["data"] for e in history if e["kind"] == "TASK_COMPLETION_REFUSED"]
    assert refused == {"task_id": task.id, "decision": "approve", "actor": "alice", "reason": "DEAD_LETTERED"}


async def test_a_dead_lettered_task_timer_fires_once_after_the_retry(engine: Engine, conn: asyncpg.Connection) -> None:
    """A task's reminder dead-lettered fails the instance. The retry entered the step again, which queued the
    reminder, due date and expiry again beside the due date and expiry still pending: the second escalation
    of the visit crashed on the first one's outbox event. The step waits again and the reminder is offered
    again: each timer fires once."""
    c = engine.client
    iid = await c.start(expense, Expense(expense_id="e-timer", employee="eve", amount=12.5))
    await engine.run_until_idle()
    await engine.move_clock(timedelta(hours=1, minutes=1))
    assert {claim.command.name for claim in await die_alone(engine)} == {"remind"}
    await engine.run_until_idle()
    assert (await c.get(iid)).status == "FAILED"
    await c.retry(iid)
    await engine.run_until_idle()
    pending = await conn.fetchval("SELECT count(*) FROM stepstone.commands WHERE instance_id = $1::uuid "
                                  "AND kind = 'TIMER' AND name = 'due' AND state = 'PENDING'", iid)
    assert pending == 1
    await engine.move_clock(timedelta(hours=4))  # past the due date
    await engine.run_until_idle()
    info = await c.get(iid)
    assert info.status == "WAITING", info
    counted = kinds(await c.history(iid))
    assert [counted.count(k) for k in ("TASK_OPENED", "TASK_REMINDED", "TASK_ESCALATED")] == [1, 1, 1]
    crashed = await conn.fetch("SELECT id FROM stepstone.commands WHERE instance_id = $1::uuid "
                               "AND last_error LIKE 'segment crashed%'", iid)
    assert crashed == []
