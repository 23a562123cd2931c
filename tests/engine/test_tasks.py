"""Human tasks against real PostgreSQL: opening, the inbox, claim, complete (two transactions),
delegation, timers held back while completing, tasks inside branches, and the races."""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import asyncpg
import pytest

from stepstone.authoring.workflow import Registry
from stepstone.client import Client
from stepstone.client_tasks import TaskFilter
from stepstone.errors import (
    IdempotencyConflict,
    InvalidInput,
    StateChangedSinceReview,
    TaskHeld,
    TaskNotOpen,
    TaskNotPermitted,
    UnknownDecision,
)
from stepstone.ops import Operations
from stepstone.testing import Engine, open_engine
from tests.crashes import die_alone
from tests.engine.task_workflows import Expense, Receipt, callback, expense, parallel, receipt, registry, review


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, registry, concurrency=4, lease_seconds=30, max_claims=3) as e:
        yield e


async def _open_expense(engine: Engine, n: int = 1) -> tuple[str, str]:
    iid = await engine.client.start(expense, Expense(expense_id=f"e-{n}", employee="eve", amount=120.5))
    await engine.run_until_idle()
    [task] = (await engine.client.tasks(user="alice", groups=["finance"])).tasks
    assert task.instance_id == iid
    return iid, task.id


async def _kinds(engine: Engine, iid: str) -> list[str]:
    return [h["kind"] for h in await engine.client.history(iid)]


async def test_a_task_opens_with_what_the_assignee_needs(engine: Engine) -> None:
    iid, tid = await _open_expense(engine)
    task = await engine.client.task(tid)
    assert task.status == "OPEN"
    assert task.title == "Approve expense e-1 of eve"
    assert (task.assignee, task.owner, task.candidate_groups, task.priority) == (None, "mia", ["finance"], 70)
    assert task.data == {"amount": 120.5, "employee": "eve"}  # a projection, never the whole state
    assert sorted(task.decisions) == ["approve", "reject"]
    approve = next(c for c in task.form["oneOf"] if c["properties"]["decision"]["const"] == "approve")
    assert approve["properties"]["payload"]["required"] == ["comment"]
    assert task.due_at is not None
    assert (await engine.client.get(iid)).status == "WAITING"
    assert await engine.client.count_tasks(user="alice", groups=["finance"]) == 1
    assert await engine.client.count_tasks(user="alice", groups=["sales"]) == 0


async def test_complete_reserves_then_the_segment_completes(engine: Engine, conn: asyncpg.Connection) -> None:
    iid, tid = await _open_expense(engine)
    done = await engine.client.complete_task(tid, "approve", {"comment": "fine"}, actor="alice",
                                             groups=["finance"], idempotency_key="k1")
    assert done.task.status == "COMPLETING" and done.command_id is not None and not done.duplicate
    cmd = await conn.fetchrow("SELECT kind, state FROM stepstone.commands WHERE id = $1", done.command_id)
    assert (cmd["kind"], cmd["state"]) == ("TASK_COMPLETION", "PENDING")
    again = await engine.client.complete_task(tid, "approve", {"comment": "fine"}, actor="alice",
                                              groups=["finance"], idempotency_key="k1")
    assert again.duplicate and again.command_id == done.command_id
    with pytest.raises(IdempotencyConflict):
        await engine.client.complete_task(tid, "reject", None, actor="alice", groups=["finance"],
                                          idempotency_key="k1")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED"
    assert (info.state["outcome"], info.state["decided_by"], info.state["comment"]) == ("APPROVED", "alice", "fine")
    assert (await engine.client.task(tid)).status == "COMPLETED"
    history = await engine.client.history(iid)
    recorded = next(h for h in history if h["kind"] == "TASK_COMPLETION_RECORDED")
    assert recorded["actor"] == "alice"
    assert "TASK_COMPLETED" in [h["kind"] for h in history]
    assert await engine.client.count_tasks(user="alice", groups=["finance"]) == 0
    with pytest.raises(TaskNotOpen) as refused:
        await engine.client.complete_task(tid, "reject", None, actor="alice", groups=["finance"])
    assert refused.value.status == "COMPLETED" and refused.value.completion is not None
    assert refused.value.completion["decision"] == "approve"


async def test_bad_completions_are_refused_and_change_nothing(engine: Engine, conn: asyncpg.Connection) -> None:
    _, tid = await _open_expense(engine)

    async def snapshot() -> list[tuple[object, ...]]:
        rows = await conn.fetch("SELECT status, completion FROM stepstone.tasks UNION ALL "
                                "SELECT state, NULL FROM stepstone.commands")
        return [tuple(r.values()) for r in rows]

    before = await snapshot()
    with pytest.raises(UnknownDecision):
        await engine.client.complete_task(tid, "maybe", None, actor="alice", groups=["finance"])
    with pytest.raises(InvalidInput, match="comment"):
        await engine.client.complete_task(tid, "approve", {"approved_amount": 3}, actor="alice", groups=["finance"])
    with pytest.raises(TaskNotPermitted):
        await engine.client.complete_task(tid, "approve", {"comment": "x"}, actor="mallory", groups=["sales"])
    with pytest.raises(InvalidInput, match="actor"):
        await engine.client.complete_task(tid, "approve", {"comment": "x"})
    assert await snapshot() == before


async def test_a_client_without_the_workflow_checks_the_payload_by_the_form(
    engine: Engine, conn: asyncpg.Connection,
) -> None:
    """The CLI, the API and the UI may run without the workflow's code: the payload is then checked by
    the task's form, every field of it, not only the required ones."""
    _, tid = await _open_expense(engine)
    bare = Client(engine.store, Registry(), actor="alice")
    before = await conn.fetch("SELECT status, completion FROM stepstone.tasks")
    with pytest.raises(InvalidInput, match="comment"):
        await bare.complete_task(tid, "approve", {"comment": ["not", "text"]}, groups=["finance"])
    with pytest.raises(InvalidInput, match="approved_amount"):
        await bare.complete_task(tid, "approve", {"comment": "ok", "approved_amount": "lots"}, groups=["finance"])
    with pytest.raises(InvalidInput, match="comment"):
        await bare.complete_task(tid, "approve", {"approved_amount": 3}, groups=["finance"])
    with pytest.raises(InvalidInput, match="takes no payload"):
        await bare.complete_task(tid, "reject", {"why": "no"}, groups=["finance"])
    assert await conn.fetch("SELECT status, completion FROM stepstone.tasks") == before
    done = await bare.complete_task(tid, "approve", {"comment": "ok", "approved_amount": 3}, groups=["finance"])
    assert done.task.completion["payload"] == {"comment": "ok", "approved_amount": 3}


async def test_a_recorded_completion_repeated_with_its_key_is_a_duplicate_before_any_payload_check(
    engine: Engine,
) -> None:
    """A completion recorded under an idempotency key, repeated with the same key and request by a caller that
    checks the payload otherwise (here by the task's form, strictly, where the first caller's model took
    "12" for a number), was refused InvalidInput: the caller could not learn that its completion was recorded.
    A committed duplicate answers before any payload check (the seed's rule); another request is still
    checked, and refused."""
    _, tid = await _open_expense(engine)
    request = {"comment": "ok", "approved_amount": "12"}
    first = await engine.client.complete_task(tid, "approve", request, actor="alice", groups=["finance"],
                                              idempotency_key="c-12")
    assert not first.duplicate
    bare = Client(engine.store, Registry(), actor="alice")
    again = await bare.complete_task(tid, "approve", request, groups=["finance"], idempotency_key="c-12")
    assert again.duplicate and again.command_id == first.command_id
    with pytest.raises(InvalidInput, match="approved_amount"):  # not the recorded request: checked as ever
        await bare.complete_task(tid, "approve", {"comment": "ok", "approved_amount": "13"}, groups=["finance"],
                                 idempotency_key="c-12")


async def test_a_user_name_no_token_can_have_is_refused(engine: Engine, conn: asyncpg.Connection) -> None:
    """A task given to " bob" (a pasted name) or "bob\n" was in nobody's inbox: a token's name, the user of
    an inbox, never has spaces around it nor a control character. Such names are refused, nothing changed."""
    iid, tid = await _open_expense(engine)
    await engine.client.claim_task(tid, actor="alice", groups=["finance"])

    async def snapshot() -> list[tuple[object, ...]]:
        rows = await conn.fetch("SELECT assignee, owner, delegation FROM stepstone.tasks")
        return [tuple(r.values()) for r in rows]

    before, history = await snapshot(), await _kinds(engine, iid)
    for name in (" bob", "bob ", "bob\n", "b\tob"):
        with pytest.raises(InvalidInput, match="to"):
            await engine.client.reassign_task(tid, name, actor="alice")
        with pytest.raises(InvalidInput, match="to"):
            await engine.client.delegate_task(tid, name, actor="alice")
        with pytest.raises(InvalidInput, match="to user"):
            await engine.client.reassign_all_tasks("alice", name, actor="lead")
        with pytest.raises(InvalidInput, match="actor"):
            await engine.client.claim_task(tid, actor=name, groups=["finance"], admin=True)
    assert await snapshot() == before and await _kinds(engine, iid) == history
    assert (await engine.client.reassign_task(tid, "bob smith", actor="alice")).assignee == "bob smith"


async def test_two_completions_at_once_one_wins(engine: Engine) -> None:
    iid, tid = await _open_expense(engine)
    results = await asyncio.gather(
        *(engine.client.complete_task(tid, d, {"comment": u} if d == "approve" else None, actor=u,
                                      groups=["finance"])
          for u, d in (("alice", "approve"), ("bob", "reject"), ("carol", "approve"), ("dan", "reject"))),
        return_exceptions=True,
    )
    won = [r for r in results if not isinstance(r, BaseException)]
    lost = [r for r in results if isinstance(r, BaseException)]
    assert len(won) == 1 and len(lost) == 3
    assert all(isinstance(e, TaskNotOpen) and e.status == "COMPLETING" for e in lost)
    winner = won[0].task.completion  # type: ignore[union-attr]
    assert all(e.completion["actor"] == winner["actor"] for e in lost)  # type: ignore[union-attr,index]
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["decided_by"] == winner["actor"]
    assert (await _kinds(engine, iid)).count("TASK_COMPLETED") == 1


async def test_claim_races_from_a_group_queue_leave_one_holder(engine: Engine) -> None:
    iid, tid = await _open_expense(engine)
    users = [f"user{n}" for n in range(8)]
    results = await asyncio.gather(*(engine.client.claim_task(tid, actor=u, groups=["finance"]) for u in users),
                                   return_exceptions=True)
    won = [r for r in results if not isinstance(r, BaseException)]
    assert len(won) == 1
    holder = won[0].assignee  # type: ignore[union-attr]
    assert all(isinstance(r, TaskHeld) and r.assignee == holder for r in results if isinstance(r, BaseException))
    assert (await engine.client.task(tid)).assignee == holder
    assert (await _kinds(engine, iid)).count("TASK_CLAIMED") == 1
    # The holder's inbox has it; another candidate's does not any more.
    other = next(u for u in users if u != holder)
    assert await engine.client.count_tasks(user=holder, groups=["finance"]) == 1
    assert await engine.client.count_tasks(user=other, groups=["finance"]) == 0
    # Claim never steals, unless an admin forces it, which is recorded.
    forced = await engine.client.claim_task(tid, actor="boss", admin=True)
    assert forced.assignee == "boss"
    claimed = [h for h in await engine.client.history(iid) if h["kind"] == "TASK_CLAIMED"]
    assert claimed[-1]["actor"] == "boss" and claimed[-1]["data"]["forced"] is True


async def test_delegate_resolve_reassign_and_bulk(engine: Engine) -> None:
    iid, tid = await _open_expense(engine)
    await engine.client.claim_task(tid, actor="alice", groups=["finance"])
    delegated = await engine.client.delegate_task(tid, "dave", actor="alice", reason="holiday")
    assert (delegated.assignee, delegated.owner, delegated.delegation) == ("dave", "mia", "PENDING")
    resolved = await engine.client.resolve_task(tid, actor="dave")
    assert (resolved.assignee, resolved.delegation) == ("mia", "RESOLVED")
    with pytest.raises(TaskNotPermitted):
        await engine.client.reassign_task(tid, "zed", actor="stranger")
    moved = await engine.client.reassign_task(tid, "olga", actor="mia", idempotency_key="r1")
    assert moved.assignee == "olga"
    assert (await engine.client.reassign_task(tid, "olga", actor="mia", idempotency_key="r1")).assignee == "olga"
    with pytest.raises(IdempotencyConflict):
        await engine.client.reassign_task(tid, "pete", actor="mia", idempotency_key="r1")
    _, tid2 = await _open_expense(engine, 2)
    await engine.client.reassign_task(tid2, "olga", actor="boss", admin=True)
    dry = await engine.client.reassign_all_tasks("olga", "pia", actor="boss", dry_run=True)
    assert (dry.reassigned, dry.skipped) == (2, 0)
    assert (await engine.client.task(tid)).assignee == "olga"
    real = await engine.client.reassign_all_tasks("olga", "pia", actor="boss", reason="olga is away")
    assert (real.reassigned, real.skipped) == (2, 0)
    assert await engine.client.count_tasks(user="pia") == 2
    kinds = await _kinds(engine, iid)
    assert kinds.count("TASK_REASSIGNED") == 2 and "TASK_DELEGATED" in kinds and "TASK_RESOLVED" in kinds
    for dry_run in (True, False):  # to the same user: refused, nothing moved and no history written
        with pytest.raises(InvalidInput, match="from and to are both 'pia'"):
            await engine.client.reassign_all_tasks("pia", "pia", actor="boss", dry_run=dry_run)
    assert (await _kinds(engine, iid)).count("TASK_REASSIGNED") == 2
    assert await engine.client.count_tasks(user="pia") == 2


async def test_reminder_then_escalation_then_expiry(engine: Engine) -> None:
    iid, tid = await _open_expense(engine)
    await engine.client.claim_task(tid, actor="alice", groups=["finance"])
    await engine.move_clock(timedelta(hours=1, minutes=1))
    await engine.run_until_idle()
    assert "TASK_REMINDED" in await _kinds(engine, iid)
    assert (await engine.client.task(tid)).reminded_at is not None
    await engine.move_clock(timedelta(hours=3))
    await engine.run_until_idle()
    task = await engine.client.task(tid)
    assert (task.assignee, task.candidate_groups, task.status) == (None, ["finance-leads"], "OPEN")
    assert await engine.client.count_tasks(user="lee", groups=["finance-leads"]) == 1
    await engine.move_clock(timedelta(days=2))
    await engine.run_until_idle()
    assert (await engine.client.task(tid)).status == "EXPIRED"
    assert (await engine.client.get(iid)).state["outcome"] == "EXPIRED"


async def test_due_timer_firing_while_completing_is_held_back(engine: Engine, conn: asyncpg.Connection) -> None:
    iid, tid = await _open_expense(engine)
    await engine.client.complete_task(tid, "approve", {"comment": "in time"}, actor="alice", groups=["finance"])
    await engine.move_clock(timedelta(days=3))  # reminder, due date and expiry have all come meanwhile
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.state["outcome"] == "APPROVED"
    kinds = await _kinds(engine, iid)
    assert not {"TASK_REMINDED", "TASK_ESCALATED", "TASK_EXPIRED"} & set(kinds)
    timers = await conn.fetch("SELECT state FROM stepstone.commands WHERE kind = 'TIMER'")
    assert {r["state"] for r in timers} == {"SUPERSEDED"}


async def test_a_worker_killed_between_reservation_and_segment_completes_once(engine: Engine) -> None:
    iid, tid = await _open_expense(engine)
    done = await engine.client.complete_task(tid, "approve", {"comment": "ok"}, actor="alice", groups=["finance"])
    [claim] = await engine.store.claim(1, 5, "doomed")  # claimed, then the worker dies: no commit, no release
    assert claim.command.id == done.command_id
    await engine.move_clock(6)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["outcome"] == "APPROVED"
    assert (await _kinds(engine, iid)).count("TASK_COMPLETED") == 1


async def test_cancelling_the_instance_cancels_its_task(engine: Engine) -> None:
    iid, tid = await _open_expense(engine)
    await engine.client.cancel(iid, "withdrawn")
    assert (await engine.client.task(tid)).status == "CANCELLED"
    with pytest.raises(TaskNotOpen):
        await engine.client.claim_task(tid, actor="alice", groups=["finance"])


async def test_tasks_inside_branches(engine: Engine) -> None:
    iid = await engine.client.start(parallel, {"users": ["ann", "ben", "cy"]})
    await engine.run_until_idle()
    for user in ("ann", "ben", "cy"):
        page = await engine.client.tasks(user=user)
        [task] = page.tasks
        assert task.position.startswith("each/")
        await engine.client.complete_task(task.id, "signed", None, actor=user)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["closed"] is True


async def test_version_stability_refuses_a_completion_on_changed_data(engine: Engine) -> None:
    iid = await engine.client.start(review, {"reviewer": "rita", "edit": True})
    await engine.run_until_idle()
    [task] = (await engine.client.tasks(user="rita")).tasks
    assert task.data == {"amount": 10}
    with pytest.raises(StateChangedSinceReview) as refused:  # the other branch changed the amount since
        await engine.client.complete_task(task.id, "ok", None, actor="rita", reviewed_version=task.state_version)
    assert refused.value.changed == ("amount",)
    assert (await engine.client.task(task.id)).status == "OPEN"
    assert (await engine.client.get(iid)).status == "WAITING"

    iid2 = await engine.client.start(review, {"reviewer": "rita", "edit": False})
    await engine.run_until_idle()
    [task2] = [t for t in (await engine.client.tasks(user="rita")).tasks if t.instance_id == iid2]
    with pytest.raises(StateChangedSinceReview):
        await engine.client.complete_task(task2.id, "ok", None, actor="rita", reviewed_version=task2.state_version + 7)
    await engine.client.complete_task(task2.id, "ok", None, actor="rita", reviewed_version=task2.state_version)
    await engine.run_until_idle()
    assert (await engine.client.get(iid2)).state["done"] is True


async def test_a_reviewed_version_no_version_can_be_is_refused(engine: Engine, conn: asyncpg.Connection) -> None:
    """A reviewed_version past what the task's bigint column holds reached the driver: asyncpg's DataError
    ("value out of int64 range"), a traceback for a caller's typo. Now it is refused as bad input, as the
    API (0 to 2**62) and the CLI (a version) refuse it, and nothing is completed."""
    _, tid = await _open_expense(engine)
    for bad in (2**70, -1, True, 1.5, "3"):
        with pytest.raises(InvalidInput, match="reviewed_version"):
            await engine.client.complete_task(tid, "approve", {"comment": "c"}, actor="alice", groups=["finance"],
                                              reviewed_version=bad)  # type: ignore[arg-type]
    assert await conn.fetchval("SELECT status FROM stepstone.tasks WHERE id = $1::uuid", tid) == "OPEN"


async def test_inbox_pages_and_filters(engine: Engine) -> None:
    for n in range(5):
        await engine.client.start(expense, Expense(expense_id=f"p-{n}", employee=f"emp{n}", amount=n))
    await engine.run_until_idle()
    first = await engine.client.tasks(user="alice", groups=["finance"], limit=2)
    second = await engine.client.tasks(user="alice", groups=["finance"], limit=2, after=first.next_cursor)
    third = await engine.client.tasks(user="alice", groups=["finance"], limit=2, after=second.next_cursor)
    ids = [t.id for p in (first, second, third) for t in p.tasks]
    assert len(ids) == len(set(ids)) == 5 and third.next_cursor is None
    found = await engine.client.tasks(user="alice", groups=["finance"], where=TaskFilter(text="EMP3"))
    assert [t.title for t in found.tasks] == ["Approve expense p-3 of emp3"]
    assert await engine.client.count_tasks(mode="all", where=TaskFilter(workflow="expense")) == 5
    assert await engine.client.count_tasks(
        mode="all", where=TaskFilter(candidate_group="finance", priority_at_least=71)) == 0
    with pytest.raises(InvalidInput):
        await engine.client.tasks(user="alice", after="garbage!")
    assert uuid.UUID(ids[0])


async def test_a_completing_task_refuses_claims_and_reassignment(engine: Engine) -> None:
    iid, tid = await _open_expense(engine)
    await engine.client.claim_task(tid, actor="alice", groups=["finance"])
    await engine.client.complete_task(tid, "reject", None, actor="alice", groups=["finance"])
    for refused in (engine.client.claim_task(tid, actor="bob", groups=["finance"], admin=True),
                    engine.client.reassign_task(tid, "zed", actor="boss", admin=True),
                    engine.client.delegate_task(tid, "zed", actor="alice")):
        with pytest.raises(TaskNotOpen) as answer:
            await refused
        assert answer.value.status == "COMPLETING" and answer.value.completion["actor"] == "alice"  # type: ignore[index]
    moved = await engine.client.reassign_all_tasks("alice", "zed", actor="boss")
    assert (moved.reassigned, moved.skipped) == (0, 1)  # being completed: skipped, and counted
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).state["outcome"] == "REJECTED"


async def test_a_dead_lettered_completion_gives_the_task_back_on_retry(engine: Engine) -> None:
    iid, tid = await _open_expense(engine)
    await engine.client.complete_task(tid, "approve", {"comment": "x"}, actor="alice", groups=["finance"])
    await die_alone(engine, lease=1)  # claimed and abandoned until the engine's max_claims (3) alone is spent
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "FAILED"
    assert (await engine.client.task(tid)).status == "COMPLETING"
    await engine.client.retry(iid)
    await engine.run_until_idle()
    assert (await engine.client.task(tid)).status == "OPEN"
    await engine.client.complete_task(tid, "reject", None, actor="bob", groups=["finance"])
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).state["outcome"] == "REJECTED"


async def test_a_priority_from_the_state_is_held_to_what_the_column_takes(engine: Engine) -> None:
    """A priority past int4 failed the commit that opens the task, on every claim, until the instance was
    dead-lettered; it is held to the column's range now, and what is no whole number is the default."""
    opened = {}
    for rank in (2**40, -(2**40), "high", 7):
        iid = await engine.client.start("ranked", {"rank": rank})
        await engine.run_until_idle()
        assert (await engine.client.get(iid)).status == "WAITING"
        [task] = await engine.client.instance_tasks(iid)
        opened[repr(rank)] = (await engine.client.task(task["id"])).priority
    assert opened == {repr(2**40): 2**31 - 1, repr(-(2**40)): -(2**31), "'high'": 50, "7": 7}


async def test_a_name_from_the_state_longer_than_an_index_holds_fails_the_instance(engine: Engine) -> None:
    """An assignee of 6,000 characters failed the commit that opens the task (an index entry holds about
    2,700 bytes) on every claim, until the instance was dead-lettered: it fails the instance at once now."""
    iid = await engine.client.start("named", {"who": secrets.token_hex(3000)})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED"
    assert info.error is not None and info.error["type"] == "InvalidTask"
    assert "assignee from the state has 6,000 characters; at most 500" in info.error["message"]
    assert await engine.client.instance_tasks(iid) == ()


async def test_a_name_from_the_state_no_user_can_have_fails_the_instance(engine: Engine) -> None:
    """An assignee the state gave as " ann" or "ann\n" opened a task for a name no actor can have (every task
    operation refuses it: docs/tasks.md, "Who may do what"), so only an admin could ever move it; a list or a
    map became its Python text ("['ann']"), a boolean "True". Such a name fails the instance as a name too
    long for the index does (InvalidTask, no task opened); a number is its text, as before."""
    for bad in (" ann", "ann\n", "an\u2028n", ["ann"], {"name": "ann"}, True):
        iid = await engine.client.start("named", {"who": bad})
        await engine.run_until_idle()
        info = await engine.client.get(iid)
        assert info.status == "FAILED", bad
        assert info.error is not None and info.error["type"] == "InvalidTask", bad
        assert "assignee from the state" in info.error["message"], (bad, info.error)
        assert await engine.client.instance_tasks(iid) == (), bad
    for good, name in ((42, "42"), ("ann smith", "ann smith")):
        iid = await engine.client.start("named", {"who": good})
        await engine.run_until_idle()
        [task] = await engine.client.instance_tasks(iid)
        assert task["assignee"] == name


async def test_a_follow_up_or_due_date_from_the_state_that_is_no_instant_fails_the_instance(engine: Engine) -> None:
    """A naive timestamp (a pydantic field set to datetime.now()) or a word gave the task no date at all,
    silently: no escalation ever came. It fails the instance now, as a timer step's `until` does."""
    for bad in ("2030-01-01T09:00:00", "tomorrow", True):
        iid = await engine.client.start(callback, {"customer": "ann", "call_at": bad})
        await engine.run_until_idle()
        info = await engine.client.get(iid)
        assert info.status == "FAILED", bad
        assert info.error is not None and info.error["type"] == "InvalidTask"
        assert "follow_up" in info.error["message"] and "instant with a zone" in info.error["message"]
        assert await engine.client.instance_tasks(iid) == ()
    for good in (None, 3600, "2030-01-01T09:00:00+01:00"):
        iid = await engine.client.start(callback, {"customer": "ann", "call_at": good})
        await engine.run_until_idle()
        assert (await engine.client.get(iid)).status == "WAITING", good


async def test_a_purged_instance_takes_its_tasks_and_subscriptions_with_it(
    engine: Engine, conn: asyncpg.Connection,
) -> None:
    """Retention purged an instance's positions, commands and history but left its task rows (with the
    data they show and the completion's payload), the idempotency keys of their operations and its
    message subscriptions, for ever."""
    iid, tid = await _open_expense(engine)
    await engine.client.reassign_task(tid, "bob", actor="mia", idempotency_key="r-1")
    await engine.client.complete_task(tid, "approve", {"comment": "ok"}, actor="bob", idempotency_key="c-1")
    waited = await engine.client.start(receipt, Receipt(order_id="o-1"))
    await engine.run_until_idle()
    await engine.client.signal(waited, "skip", {"n": 1})
    await engine.run_until_idle()
    kept_iid, kept_tid = await _open_expense(engine, 2)  # still waiting: never archived nor purged
    assert {(await engine.client.get(i)).status for i in (iid, waited)} == {"COMPLETED"}
    ops = Operations.on(engine.store, actor="oncall")
    await engine.move_clock(31 * 86_400)
    assert (await ops.retention_run()).archived == 2
    await engine.move_clock(2 * 86_400)
    assert (await ops.retention_run()).purged == 2
    gone = [uuid.UUID(iid), uuid.UUID(waited)]
    for table in ("tasks", "subscriptions"):
        left = await conn.fetchval(f"SELECT count(*) FROM stepstone.{table} WHERE instance_id = ANY($1::uuid[])", gone)
        assert left == 0, table
    assert await conn.fetchval("SELECT count(*) FROM stepstone.dedup WHERE namespace = $1", tid) == 0
    assert (await engine.client.task(kept_tid)).status == "OPEN"
    assert [t.instance_id for t in (await engine.client.tasks(user="alice", groups=["finance"])).tasks] == [kept_iid]


async def test_a_task_that_names_nobody_is_anyones(engine: Engine) -> None:
    """What docs/tasks.md now says: a task with no assignee, owner or candidate (an assignee read from a
    state field that is missing) may be claimed and completed by anyone; name candidates to prevent it."""
    iid = await engine.client.start("named", {"who": None})
    await engine.run_until_idle()
    [task] = await engine.client.instance_tasks(iid)
    info = await engine.client.task(task["id"])
    assert (info.assignee, info.owner, info.candidate_users, info.candidate_groups) == (None, None, [], [])
    assert (await engine.client.claim_task(info.id, actor="anyone")).assignee == "anyone"
    await engine.client.complete_task(info.id, "done", None, actor="anyone")
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"


async def test_a_reassign_or_delegate_to_the_assignee_changes_nothing(engine: Engine) -> None:
    """It recorded TASK_REASSIGNED (TASK_DELEGATED, and made the assignee its own owner) though nothing
    moved. Now it answers the task as it is and records nothing; one who may not hand it on is still
    refused."""
    iid, tid = await _open_expense(engine)
    claimed = await engine.client.claim_task(tid, actor="alice", groups=["finance"])
    before = await _kinds(engine, iid)
    with pytest.raises(TaskNotPermitted):
        await engine.client.reassign_task(tid, "alice", actor="stranger")
    for again in (engine.client.reassign_task, engine.client.delegate_task):
        task = await again(tid, "alice", actor="alice", idempotency_key="same")
        assert (task.assignee, task.owner, task.delegation) == ("alice", claimed.owner, None)
    assert await _kinds(engine, iid) == before
    moved = await engine.client.reassign_task(tid, "olga", actor="alice")
    assert moved.assignee == "olga" and (await _kinds(engine, iid)).count("TASK_REASSIGNED") == 1


async def test_an_idempotency_key_repeated_by_another_actor_is_refused(engine: Engine) -> None:
    """A completion's and a reassignment's key answered "duplicate" (and the task) to whoever repeated the
    request, even an actor not permitted on the task: the key was looked up before the permission check,
    and the request it recorded did not say who made it. A command carries its actor, so another actor's
    repeat is another command: IdempotencyConflict, nothing changed; the same actor's repeat is a duplicate."""
    _, tid = await _open_expense(engine)
    request = {"comment": "fine", "approved_amount": "12"}  # the model takes "12" for a number, the form does not
    done = await engine.client.complete_task(tid, "approve", request, actor="alice", groups=["finance"],
                                             idempotency_key="k1")
    for who, groups in (("mallory", ["sales"]), ("bob", ["finance"])):  # not permitted; a candidate
        with pytest.raises(IdempotencyConflict, match="by another actor"):
            await engine.client.complete_task(tid, "approve", request, actor=who, groups=groups,
                                              idempotency_key="k1")
    with pytest.raises(InvalidInput, match="approved_amount"):  # not its repeat: checked (by the form), refused
        await Client(engine.store, Registry(), actor="mallory").complete_task(tid, "approve", request,
                                                                              idempotency_key="k1")
    again = await Client(engine.store, Registry(), actor="alice").complete_task(tid, "approve", request,
                                                                                idempotency_key="k1")
    assert again.duplicate and again.command_id == done.command_id

    iid2, tid2 = await _open_expense(engine, 2)
    await engine.client.reassign_task(tid2, "olga", actor="mia", idempotency_key="r1")
    before = await _kinds(engine, iid2)
    for who in ("stranger", "olga"):  # not permitted; the assignee now
        with pytest.raises(IdempotencyConflict, match="another actor"):
            await engine.client.reassign_task(tid2, "olga", actor=who, idempotency_key="r1")
    assert (await engine.client.reassign_task(tid2, "olga", actor="mia", idempotency_key="r1")).assignee == "olga"
    assert await _kinds(engine, iid2) == before


async def test_a_key_an_earlier_release_recorded_stays_a_duplicate_across_the_upgrade(engine: Engine) -> None:
    """Keys recorded before the actor joined a task operation's fingerprint (the request alone): the same
    request repeated after the upgrade is still answered as a duplicate, not IdempotencyConflict; a
    completion's only by the actor it names."""
    from stepstone.client_tasks import _fingerprint  # noqa: PLC0415 - what the earlier release wrote

    _, tid = await _open_expense(engine)
    request = {"comment": "fine", "approved_amount": 12}
    outcome, _, _ = await engine.store.task_complete(  # as the earlier release's client recorded it
        tid, "approve", request, actor="alice", groups=["finance"], force=False, key="old",
        fingerprint=_fingerprint("complete", "approve", request), reviewed_version=None)
    assert outcome == "reserved"
    again = await engine.client.complete_task(tid, "approve", request, actor="alice", groups=["finance"],
                                              idempotency_key="old")
    assert again.duplicate
    with pytest.raises(IdempotencyConflict, match="by another actor"):
        await engine.client.complete_task(tid, "approve", request, actor="bob", groups=["finance"],
                                          idempotency_key="old")
    _, tid2 = await _open_expense(engine, 2)
    outcome, _ = await engine.store.task_assign(
        tid2, "reassign", to="olga", actor="mia", groups=[], force=False, reason="",
        key="old", fingerprint=_fingerprint("reassign", "olga", ""))
    assert outcome == "ok"
    assert (await engine.client.reassign_task(tid2, "olga", actor="mia", idempotency_key="old")).assignee == "olga"
