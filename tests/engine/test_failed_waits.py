"""Correlated messages and an instance that has FAILED while one of its waits is open, against real PostgreSQL.

A branch of a FAILED instance is not stopped (docs/branches.md): its open wait takes a message and goes on, and
the retry runs only the failed branch. A position that failed at its wait (a command of it dead-lettered, its
step deadline passed) takes none: a message published meanwhile goes to another open wait of its key or to the
buffer. A message whose own command was dead-lettered is offered again to its wait by the retry, and applied
there once. A saga compensating closes its waits.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from stepstone import Retry
from stepstone.authoring.workflow import END, CompensationContext, Registry, StepContext, Workflow
from stepstone.core.model import Decision, RunStep, StepFailed
from stepstone.core.transitions import apply, complete_step
from stepstone.store.port import Claim, CommitRequest
from stepstone.testing import Engine, open_engine
from tests.crashes import die_alone
from tests.engine.conftest import kinds

FAILING: set[str] = set()
"""The keys whose `flaky` branch raises (on its only attempt)."""

# A fork of `w` (a wait for message `m` by the key `k`) and `f` (a step that fails for the keys in FAILING),
# joined by all: `f` failing fails the instance while `w` waits.
forked = Workflow("failed_fork", version=1)
forked.fork("split", branches={"w": "await_m", "f": "flaky"}, start=True)
forked.wait("await_m", messages={"m": "took"}, correlation="k")


@forked.step(next="met")
async def took(ctx: StepContext, state: dict[str, Any]) -> None:
    assert ctx.signal is not None
    state.setdefault("got", []).append((ctx.signal.payload or {}).get("n"))


@forked.step(next="met", retry=Retry(max_attempts=1))
async def flaky(ctx: StepContext, state: dict[str, Any]) -> None:
    if state["k"] in FAILING:
        raise ValueError("flaky refused")


forked.join("met", fork="split", next="done")


@forked.step(next=END)
async def done(ctx: StepContext, state: dict[str, Any]) -> None:
    state["done"] = True


# A wait at the root for message `m` by the key `k`, with a timeout.
timed = Workflow("failed_timed", version=1)
timed.wait("await_m", messages={"m": "answered"}, correlation="k", timeout=timedelta(hours=1),
           on_timeout="answered", start=True)


@timed.step(next=END)
async def answered(ctx: StepContext, state: dict[str, Any]) -> None:
    state.setdefault("got", []).append(None if ctx.signal is None else (ctx.signal.payload or {}).get("n"))


# A wait at the root for message `m` by the key `k` that must be left within 5 s, or it fails.
bounded = Workflow("failed_bounded", version=1)
bounded.wait("await_m", messages={"m": "answered"}, correlation="k", deadline=5, start=True)
bounded.step(answered, name="answered", next=END)


# The fork in a saga: a compensable step before it. `f` failing begins compensation, whose `undo_book` fails
# for good: the instance stops COMPENSATION_FAILED, for an operator.
saga = Workflow("failed_saga", version=1)


@saga.step(start=True, next="split")
async def book(ctx: StepContext, state: dict[str, Any]) -> None:
    ctx.record("booked")


@saga.compensation("book", retry=Retry(max_attempts=1))
async def undo_book(ctx: CompensationContext, state: dict[str, Any], recorded: Any) -> None:
    raise ValueError("undo refused")


saga.fork("split", branches={"w": "await_m", "f": "flaky"})
saga.wait("await_m", messages={"m": "took"}, correlation="k")
saga.step(took, name="took", next="met")
saga.step(flaky, name="flaky", next="met", retry=Retry(max_attempts=1))
saga.join("met", fork="split", next="done")
saga.step(done, name="done", next=END)


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    FAILING.clear()
    async with open_engine(database_url, Registry(forked, timed, bounded, saga), concurrency=2, max_claims=3) as e:
        yield e
    FAILING.clear()


async def _failed_with_a_waiting_branch(engine: Engine, key: str) -> str:
    FAILING.add(key)
    iid = await engine.client.start(forked, {"k": key})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED"
    assert {p["path"]: p["status"] for p in info.positions} == {"": "WAITING", "split/f": "FAILED",
                                                                "split/w": "WAITING"}
    return iid


async def _correlated(engine: Engine, iid: str) -> list[Any]:
    return [e["data"]["message_id"] for e in await engine.client.history(iid) if e["kind"] == "MESSAGE_CORRELATED"]


async def test_a_waiting_branch_of_a_failed_instance_takes_its_message_and_the_retry_applies_it_once(
    engine: Engine, conn: asyncpg.Connection,
) -> None:
    """Holds what was found right: the branch goes on with the message while the instance is FAILED (as every
    other branch of a failed instance does), and the retry runs the failed branch alone."""
    c = engine.client
    iid = await _failed_with_a_waiting_branch(engine, "f-1")
    published = await c.publish_message("m", "f-1", {"n": 1}, message_id="m-f-1")
    assert [(d.instance_id, d.position) for d in published.deliveries] == [(iid, "split/w")]
    await engine.run_until_idle()
    info = await c.get(iid)
    assert info.status == "FAILED" and info.state["got"] == [1]
    assert {p["path"]: p["status"] for p in info.positions}["split/w"] == "COMPLETED"  # arrived at the join
    FAILING.clear()
    await c.retry(iid)
    await engine.run_until_idle()
    info = await c.get(iid)
    assert (info.status, info.state["got"], info.state["done"]) == ("COMPLETED", [1], True)
    assert await _correlated(engine, iid) == ["m-f-1"]
    assert await conn.fetchval("SELECT status FROM stepstone.messages WHERE message_id = 'm-f-1'") == "DELIVERED"


async def test_correlate_all_reaches_a_failed_instances_waiting_branch_once(engine: Engine) -> None:
    """With correlate_all, the failed instance's waiting branch is one of the open waits, and each applies the
    message once; a message without it goes to the oldest open wait, the failed instance's here."""
    c = engine.client
    failed = await _failed_with_a_waiting_branch(engine, "f-all")
    running = await c.start(timed, {"k": "f-all"})
    await engine.run_until_idle()
    published = await c.publish_message("m", "f-all", {"n": 2}, message_id="m-all", correlate_all=True)
    assert {d.instance_id for d in published.deliveries} == {failed, running}
    await engine.run_until_idle()
    assert (await c.get(running)).state["got"] == [2]
    assert (await c.get(failed)).state["got"] == [2]
    assert await _correlated(engine, failed) == await _correlated(engine, running) == ["m-all"]


async def _failed_at_its_wait(engine: Engine, key: str, how: str) -> str:
    """A root wait that failed: its timeout timer dead-lettered (it crashed its workers), or its step deadline
    passed with no on_deadline. The instance FAILED at the wait, its position FAILED."""
    workflow = timed if how == "dead_timer" else bounded
    iid = await engine.client.start(workflow, {"k": key})
    await engine.run_until_idle()
    if how == "dead_timer":
        await engine.move_clock(timedelta(hours=1, seconds=1))
        assert {claim.command.kind for claim in await die_alone(engine)} == {"TIMER"}
    else:
        await engine.move_clock(timedelta(seconds=6))
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED" and info.error is not None
    assert info.error["type"] == ("DeadLetter" if how == "dead_timer" else "StepDeadline"), info.error
    assert [p["status"] for p in info.positions if p["path"] == ""] == ["FAILED"]
    return iid


@pytest.mark.parametrize("how", ["dead_timer", "step_deadline"])
async def test_a_wait_that_failed_takes_no_message_and_its_retry_takes_one_from_the_buffer(
    engine: Engine, conn: asyncpg.Connection, how: str,
) -> None:
    """Holds what was found right: a failed position's wait acts on nothing until it is retried, so a message
    of its key goes past it, to another open wait (never stuck with the failed one while that wait starves) or,
    with none, to the buffer; the retry enters the wait again, which takes the buffered message."""
    c = engine.client
    stuck = await _failed_at_its_wait(engine, "w-1", how)
    other = await c.start(timed, {"k": "w-1"})
    await engine.run_until_idle()
    to_other = await c.publish_message("m", "w-1", {"n": 1}, correlate_all=True)
    assert [d.instance_id for d in to_other.deliveries] == [other]
    buffered = await c.publish_message("m", "w-1", {"n": 2}, ttl=600, message_id="m-w-1")
    assert buffered.outcome == "buffered"
    await engine.run_until_idle()
    assert (await c.get(other)).state["got"] == [1]
    assert (await c.get(stuck)).status == "FAILED"
    await c.retry(stuck)
    await engine.run_until_idle()
    info = await c.get(stuck)
    assert (info.status, info.state["got"]) == ("COMPLETED", [2]), info
    assert await _correlated(engine, stuck) == ["m-w-1"]


async def test_a_dead_lettered_message_is_offered_again_by_the_retry(engine: Engine, conn: asyncpg.Connection) -> None:
    """A message whose command crashed its workers until it was dead-lettered fails its wait, the instance
    FAILED. The retry superseded the command (RETRIED) and entered the wait again: the message, DELIVERED to
    that instance, was never applied, and the wait waited for another. It is offered again to the wait it
    was delivered to, which takes it once: the wait's subscription stays used meanwhile, so another message
    of its key is buffered, not given to the same wait."""
    c = engine.client
    iid = await c.start(timed, {"k": "d-1"})
    await engine.run_until_idle()
    published = await c.publish_message("m", "d-1", {"n": 7}, message_id="m-d-1")
    assert [d.instance_id for d in published.deliveries] == [iid]
    assert {claim.command.kind for claim in await die_alone(engine)} == {"MESSAGE"}
    await engine.run_until_idle()
    info = await c.get(iid)
    assert info.status == "FAILED" and info.error is not None and info.error["type"] == "DeadLetter"
    await c.retry(iid)
    later = await c.publish_message("m", "d-1", {"n": 8}, ttl=600, message_id="m-d-2")
    assert later.outcome == "buffered", later
    await engine.run_until_idle()
    info = await c.get(iid)
    assert (info.status, info.state["got"]) == ("COMPLETED", [7]), info
    assert await _correlated(engine, iid) == ["m-d-1"]
    assert kinds(await c.history(iid)).count("WAITING") == 1  # the wait was not entered again
    [command] = await conn.fetch("SELECT state, claims FROM stepstone.commands WHERE kind = 'MESSAGE' "
                                 "AND instance_id = $1::uuid", iid)
    assert command["state"] == "COMPLETE"
    assert await conn.fetchval("SELECT status FROM stepstone.messages WHERE message_id = 'm-d-2'") == "BUFFERED"


async def test_a_dead_lettered_buffered_message_is_offered_again_to_its_instance(
    engine: Engine, conn: asyncpg.Connection,
) -> None:
    """A message the wait took from the buffer, dead-lettered there, goes to that wait again on the retry:
    not to another open wait of its key (it was delivered; the instance it was delivered to applies it)."""
    c = engine.client
    assert (await c.publish_message("m", "d-2", {"n": 9}, ttl=600, message_id="m-d-3")).outcome == "buffered"
    iid = await c.start(timed, {"k": "d-2"})
    [start] = await engine.store.claim(1, 30, "w")  # its commit enters the wait, which takes the message
    decision = apply(start.instance, start.command, timed.plan, start.now)
    assert isinstance(decision, Decision) and start.command.kind == "START", decision
    assert await engine.store.commit(CommitRequest(start, start.command.id, decision, start.instance.visit,
                                                   start.instance.state_version), lease_seconds=30, worker="w")
    other = await c.start(timed, {"k": "d-2"})  # opens its wait after the message was taken
    assert {claim.command.kind for claim in await die_alone(engine)} == {"MESSAGE"}
    await engine.run_until_idle()
    assert (await c.get(iid)).status == "FAILED" and (await c.get(other)).status == "WAITING"
    await c.retry(iid)
    await engine.run_until_idle()
    info = await c.get(iid)
    assert (info.status, info.state.get("got")) == ("COMPLETED", [9]), info
    assert await _correlated(engine, iid) == ["m-d-3"]
    assert (await c.get(other)).status == "WAITING"
    assert await conn.fetchval("SELECT status FROM stepstone.messages WHERE message_id = 'm-d-3'") == "DELIVERED"


async def _commit_by_hand(engine: Engine, workflow: Workflow[Any], claim: Claim) -> None:
    """Commit a claimed command as a worker would, an action step's handler failing for good."""
    decided = apply(claim.instance, claim.command, workflow.plan, claim.now)
    if isinstance(decided, RunStep):
        decided = complete_step(claim.instance, claim.command, workflow.plan,
                                StepFailed("ValueError", "flaky refused", retryable=False), claim.now)
    assert isinstance(decided, Decision), decided
    request = CommitRequest(claim, claim.command.id, decided, claim.instance.visit, claim.instance.state_version)
    assert await engine.store.commit(request, lease_seconds=30, worker="w") is not None


async def test_a_cancelled_failed_instance_hands_on_the_buffered_message_its_wait_took(
    engine: Engine, conn: asyncpg.Connection,
) -> None:
    """Holds what was found right: the waiting branch of an instance FAILED by its other branch took a buffered
    message, whose command is still to be applied when the instance is cancelled: the cancel settles it
    CANCELLED and the message goes back to the buffer (no other wait of its key open), where the next wait of
    the key takes it, as from any cancelled instance."""
    c = engine.client
    assert (await c.publish_message("m", "c-1", {"n": 5}, ttl=600, message_id="m-c-1")).outcome == "buffered"
    iid = await c.start(forked, {"k": "c-1"})
    [fork] = await engine.store.claim(8, 30, "w")
    await _commit_by_hand(engine, forked, fork)
    branches = await engine.store.claim(8, 30, "w")  # w enters its wait and takes the message; f fails
    assert sorted(b.instance.position for b in branches) == ["split/f", "split/w"]
    for claim in branches:
        await _commit_by_hand(engine, forked, claim)
    assert (await c.get(iid)).status == "FAILED"
    assert await conn.fetchval("SELECT state FROM stepstone.commands WHERE kind = 'MESSAGE'") == "PENDING"
    assert await c.cancel(iid, "given up") == "CANCELLED"
    assert await conn.fetchval("SELECT status FROM stepstone.messages WHERE message_id = 'm-c-1'") == "BUFFERED"
    later = await c.start(timed, {"k": "c-1"})
    await engine.run_until_idle()
    assert (await c.get(later)).state["got"] == [5]
    assert await _correlated(engine, iid) == []


async def test_a_saga_stopped_compensating_closes_its_waits(engine: Engine, conn: asyncpg.Connection) -> None:
    """Holds what was found right: a saga whose branch fails compensates instead of staying FAILED, and beginning
    that closes every open wait of it (COMPENSATION_FAILED here, stopped for an operator): a message of the key
    is buffered, not given to the closed wait, and a later wait of the key takes it."""
    c = engine.client
    FAILING.add("s-1")
    iid = await c.start(saga, {"k": "s-1"})
    await engine.run_until_idle()
    assert (await c.get(iid)).status == "COMPENSATION_FAILED"
    assert await conn.fetchval("SELECT status FROM stepstone.subscriptions WHERE instance_id = $1::uuid",
                               iid) == "CLOSED"
    published = await c.publish_message("m", "s-1", {"n": 3}, ttl=600, message_id="m-s-1")
    assert published.outcome == "buffered", published
    later = await c.start(timed, {"k": "s-1"})
    await engine.run_until_idle()
    assert (await c.get(later)).state["got"] == [3]
