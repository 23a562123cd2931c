"""A human task's completion key after the completion is handed back, against real PostgreSQL.

A completion reserves its task under its idempotency key. When the completion is handed back (refused by the
segment, or dead-lettered and its instance retried) the task is OPEN again: the key's repeat of the same
request is a new request that reserves the task again, never the earlier answer for a completion that was not
made; another request under the key is still a conflict, and a task another completion took since answers as
taken (`TaskNotOpen`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import asyncpg
import pytest

from stepstone.authoring.workflow import Registry
from stepstone.client import Client
from stepstone.core.model import Decision
from stepstone.core.transitions import apply
from stepstone.errors import IdempotencyConflict, InvalidInput, TaskNotOpen
from stepstone.store.port import CommitRequest
from stepstone.testing import Engine, open_engine
from tests.crashes import die_alone
from tests.engine.task_workflows import Expense, expense, registry

APPROVE = {"comment": "ok", "approved_amount": "12"}  # the model takes "12"; the form, strictly, not


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, registry, concurrency=2, lease_seconds=30, max_claims=3) as e:
        yield e


async def _handed_back_after_dead_letter(engine: Engine, key: str = "k-1") -> tuple[str, str]:
    """alice's completion under `key` was dead-lettered and the instance retried: the task is OPEN again."""
    c = engine.client
    iid = await c.start(expense, Expense(expense_id="e-key", employee="eve", amount=12.5))
    await engine.run_until_idle()
    [task] = (await c.tasks(user="alice", groups=["finance"])).tasks
    first = await c.complete_task(task.id, "approve", APPROVE, actor="alice", groups=["finance"],
                                  idempotency_key=key)
    assert not first.duplicate
    assert {claim.command.kind for claim in await die_alone(engine)} == {"TASK_COMPLETION"}
    await engine.run_until_idle()
    assert (await c.get(iid)).status == "FAILED"
    await c.retry(iid)
    await engine.run_until_idle()
    assert (await c.task(task.id)).status == "OPEN"
    return iid, task.id


async def test_the_same_request_under_its_key_completes_a_task_given_back_by_a_retry(engine: Engine) -> None:
    """The repeat answered the dead completion's reservation as a duplicate and recorded nothing, the task OPEN:
    the caller was told it worked and the instance waited."""
    c = engine.client
    iid, tid = await _handed_back_after_dead_letter(engine)
    again = await c.complete_task(tid, "approve", APPROVE, actor="alice", groups=["finance"], idempotency_key="k-1")
    assert (again.duplicate, again.task.status) == (False, "COMPLETING")
    assert again.command_id is not None
    # Its own repeat, while this completion holds the task, is the duplicate.
    third = await c.complete_task(tid, "approve", APPROVE, actor="alice", groups=["finance"], idempotency_key="k-1")
    assert (third.duplicate, third.command_id) == (True, again.command_id)
    await engine.run_until_idle()
    info = await c.get(iid)
    assert (info.status, info.state["outcome"], info.state["decided_by"]) == ("COMPLETED", "APPROVED", "alice")
    done = await c.complete_task(tid, "approve", APPROVE, actor="alice", groups=["finance"], idempotency_key="k-1")
    assert (done.duplicate, done.task.status) == (True, "COMPLETED")


async def test_another_request_under_a_handed_back_key_is_still_a_conflict(engine: Engine) -> None:
    c = engine.client
    _, tid = await _handed_back_after_dead_letter(engine)
    with pytest.raises(IdempotencyConflict):
        await c.complete_task(tid, "reject", None, actor="alice", groups=["finance"], idempotency_key="k-1")
    with pytest.raises(IdempotencyConflict):  # the same request by another actor is another request
        await c.complete_task(tid, "approve", APPROVE, actor="bob", groups=["finance"], idempotency_key="k-1")
    assert (await c.task(tid)).status == "OPEN"


async def test_a_handed_back_key_repeated_after_another_completion_won_is_refused(engine: Engine) -> None:
    """The repeat answered as a duplicate, the task carrying bob's completion: alice was told hers was made."""
    c = engine.client
    _, tid = await _handed_back_after_dead_letter(engine)
    await c.complete_task(tid, "reject", None, actor="bob", groups=["finance", "finance-leads"],
                          idempotency_key="b-1")
    with pytest.raises(TaskNotOpen) as refused:
        await c.complete_task(tid, "approve", APPROVE, actor="alice", groups=["finance"], idempotency_key="k-1")
    assert refused.value.completion is not None and refused.value.completion["actor"] == "bob"


async def test_a_handed_back_key_is_checked_as_a_new_request(engine: Engine) -> None:
    """A recorded completion's repeat answers before any payload check; a handed-back one's was answered so too
    (a duplicate, nothing recorded). It is checked, here by the task's form, and refused."""
    _, tid = await _handed_back_after_dead_letter(engine)
    bare = Client(engine.store, Registry(), actor="alice")
    with pytest.raises(InvalidInput, match="approved_amount"):
        await bare.complete_task(tid, "approve", APPROVE, groups=["finance"], idempotency_key="k-1")
    assert (await engine.client.task(tid)).status == "OPEN"


async def test_the_same_request_under_its_key_completes_a_task_the_segment_gave_back(
    engine: Engine, conn: asyncpg.Connection,
) -> None:
    """A completion the segment refused (the position no longer at that task's visit) reopens the task; the
    key's repeat recorded nothing, answered as a duplicate."""
    c = engine.client
    iid = await c.start(expense, Expense(expense_id="e-refused", employee="eve", amount=12.5))
    await engine.run_until_idle()
    [task] = (await c.tasks(user="alice", groups=["finance"])).tasks
    await c.complete_task(task.id, "approve", APPROVE, actor="alice", groups=["finance"], idempotency_key="k-2")
    [claim] = await engine.store.claim(1, 30, "w")
    assert claim.command.kind == "TASK_COMPLETION"
    elsewhere = dataclasses.replace(claim.instance, visit=claim.instance.visit + 1)  # TASK_NOT_CURRENT
    decision = apply(elsewhere, claim.command, expense.plan, claim.now)
    assert isinstance(decision, Decision), decision
    assert await engine.store.commit(CommitRequest(claim, claim.command.id, decision, claim.instance.visit,
                                                   claim.instance.state_version), lease_seconds=30, worker="w")
    assert (await c.task(task.id)).status == "OPEN"
    again = await c.complete_task(task.id, "approve", APPROVE, actor="alice", groups=["finance"],
                                  idempotency_key="k-2")
    assert (again.duplicate, again.task.status) == (False, "COMPLETING")
    await engine.run_until_idle()
    assert (await c.get(iid)).state["outcome"] == "APPROVED"
    refused = await conn.fetchval("SELECT count(*) FROM stepstone.history WHERE instance_id = $1::uuid "
                                  "AND kind = 'TASK_COMPLETION_REFUSED'", iid)
    assert refused == 1
