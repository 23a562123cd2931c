"""A buffered message taken by a wait that something else then leaves goes on to the next wait of its
name and key, against real PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from stepstone.authoring.workflow import END, Registry, StepContext, Workflow
from stepstone.core.model import Decision
from stepstone.core.transitions import apply
from stepstone.store.port import CommitRequest
from stepstone.testing import open_engine
from tests._pg import until_blocked
from tests.engine.crossed_groups import commit_crossed, ids_in_start_order

# A wait taking message `m` by the key `k`, or the signal `skip`; `took` records what came and goes back to
# the wait while `rounds` asks for more. On a skip for a key in `gate`, `took` says it began (the first
# event) and waits for the test to let it go on (the second).
looped = Workflow("looped", version=1)
gate: dict[str, tuple[asyncio.Event, asyncio.Event]] = {}


@looped.step(start=True, next="await_m")
async def begin(ctx: StepContext, state: dict[str, Any]) -> None:
    state["got"] = []


looped.wait("await_m", messages={"m": "took"}, signals={"skip": "took"}, correlation="k")


@looped.step(next=["await_m", END])
async def took(ctx: StepContext, state: dict[str, Any]) -> str:
    assert ctx.signal is not None
    state["got"].append([ctx.signal.name, (ctx.signal.payload or {}).get("n")])
    held = gate.get(state["k"])
    if held is not None and ctx.signal.name == "skip":
        held[0].set()
        await held[1].wait()
    return "await_m" if len(state["got"]) < state.get("rounds", 1) else END


async def _second_waits_while_first_skips(engine: Any, key: str, n: int) -> tuple[str, str, asyncio.Future[None]]:
    """A message buffered for `key` taken by the first instance's wait, which a skip queued before it wins:
    the skip's step runs (held at `gate[key]`) with the message's command behind it, while a second instance
    enters its wait of the key and finds nothing buffered. Returns both ids and the first's run."""
    c = engine.client
    assert (await c.publish_message("m", key, {"n": n}, ttl=600)).outcome == "buffered"
    first = await c.start(looped, {"k": key})
    await c.signal(first, "skip", {"n": 0})
    running = asyncio.ensure_future(engine.run_until_idle())
    await gate[key][0].wait()  # `took` runs for the skip; the message's command waits behind it
    second = await c.start(looped, {"k": key})
    await engine.new_worker(concurrency=2).run_until_idle()  # the second enters its wait meanwhile
    assert (await c.get(second)).status == "WAITING"
    return first, second, running


@contextlib.asynccontextmanager
async def _row_held(database_url: str, instance: str) -> AsyncIterator[asyncpg.Connection]:
    """A transaction of another connection holding the instance's row (its commit, a signal, a publish)."""
    holder = await asyncpg.connect(database_url)
    try:
        async with holder.transaction():
            await holder.execute("SELECT 1 FROM stepstone.instances WHERE id = $1::uuid FOR UPDATE", instance)
            yield holder
    finally:
        await holder.close()


async def test_a_buffered_message_a_signal_beat_reaches_the_next_wait(
    database_url: str, conn: asyncpg.Connection,
) -> None:
    """The commit entering the wait takes the buffered message; the signal queued before it wins the wait.
    The message's command was parked and, at the instance's end, rejected (INSTANCE_ENDED): the next wait
    of its key, another instance's or the same instance's, never got it though it was buffered for it."""
    async with open_engine(database_url, Registry(looped), concurrency=2) as engine:
        c = engine.client
        assert (await c.publish_message("m", "k-1", {"n": 1}, ttl=600, message_id="b-1")).outcome == "buffered"
        first = await c.start(looped, {"k": "k-1"})
        await c.signal(first, "skip", {"n": 0})  # queued before the wait is entered
        await engine.run_until_idle()
        assert (await c.get(first)).state["got"] == [["skip", 0]]
        nxt = await c.start(looped, {"k": "k-1"})  # another instance's wait of that key
        await engine.run_until_idle()
        info = await c.get(nxt)
        assert (info.status, info.state["got"]) == ("COMPLETED", [["m", 1]]), info
        assert await conn.fetchval("SELECT status FROM stepstone.messages WHERE message_id = 'b-1'") == "DELIVERED"
        # It ended before the command was applied: the command is rejected, the message went on.
        assert await conn.fetchval("SELECT state FROM stepstone.commands WHERE kind = 'MESSAGE' "
                                   "AND instance_id = $1::uuid ORDER BY id LIMIT 1", first) == "REJECTED"

        # The same instance's later wait: the signal wins the first, the message reaches the second.
        assert (await c.publish_message("m", "k-2", {"n": 2}, ttl=600)).outcome == "buffered"
        same = await c.start(looped, {"k": "k-2", "rounds": 2})
        await c.signal(same, "skip", {"n": 0})
        await engine.run_until_idle()
        info = await c.get(same)
        assert (info.status, info.state["got"]) == ("COMPLETED", [["skip", 0], ["m", 2]]), info
        # Applied to the wait it was taken for, which the skip had left: returned, not parked.
        kinds = [e["kind"] for e in await c.history(same)]
        assert "MESSAGE_RETURNED" in kinds and "MESSAGE_PARKED" not in kinds, kinds


async def test_a_returned_message_goes_to_a_wait_already_open(database_url: str, conn: asyncpg.Connection) -> None:
    """A wait of the key that opened while the message was on its way to the first (and so found nothing
    buffered) gets it when the first's wait turns out to be left, as the oldest open subscription."""
    gate["k-open"] = asyncio.Event(), (go_on := asyncio.Event())
    try:
        async with open_engine(database_url, Registry(looped), concurrency=4) as engine:
            c = engine.client
            first, second, running = await _second_waits_while_first_skips(engine, "k-open", 7)
            go_on.set()
            await running
            await engine.run_until_idle()
            assert (await c.get(first)).state["got"] == [["skip", 0]]
            info = await c.get(second)
            assert (info.status, info.state["got"]) == ("COMPLETED", [["m", 7]]), info
    finally:
        gate.pop("k-open", None)


async def test_a_returned_message_is_kept_until_its_expires_at(
    database_url: str, conn: asyncpg.Connection,
) -> None:
    """Returned, the message is buffered until the expires_at its publish gave it, not longer."""
    async with open_engine(database_url, Registry(looped), concurrency=2) as engine:
        c = engine.client
        await c.publish_message("m", "k-old", {"n": 1}, ttl=5)
        first = await c.start(looped, {"k": "k-old"})
        await c.signal(first, "skip", {"n": 0})
        await engine.run_until_idle()
        assert await conn.fetchval("SELECT status FROM stepstone.messages") == "BUFFERED"
        await engine.move_clock(6)
        late = await c.start(looped, {"k": "k-old"})
        await engine.run_until_idle()
        assert (await c.get(late)).status == "WAITING"


async def test_a_message_whose_ttl_passed_on_its_way_expires(database_url: str, conn: asyncpg.Connection) -> None:
    """Handed back after its expires_at (the clock moved while the skip's step ran), the message is as a
    buffered one no wait took in time: EXPIRED, and no later wait gets it."""
    began, go_on = gate["k-gone"] = asyncio.Event(), asyncio.Event()
    try:
        async with open_engine(database_url, Registry(looped), concurrency=2, lease_seconds=600) as engine:
            c = engine.client
            await c.publish_message("m", "k-gone", {"n": 1}, ttl=5)
            first = await c.start(looped, {"k": "k-gone"})
            await c.signal(first, "skip", {"n": 0})
            running = asyncio.ensure_future(engine.run_until_idle())
            await began.wait()
            await engine.move_clock(6)
            go_on.set()
            await running
            assert await conn.fetchval("SELECT status FROM stepstone.messages") == "EXPIRED"
            late = await c.start(looped, {"k": "k-gone"})
            await engine.run_until_idle()
            assert (await c.get(late)).status == "WAITING"
    finally:
        gate.pop("k-gone", None)


async def test_a_returned_message_reaches_an_open_wait_whose_instance_is_busy(
    database_url: str, conn: asyncpg.Connection,
) -> None:
    """The oldest open wait of the key is on an instance whose row another transaction holds while the
    message is handed on (its commit, a signal, a publish). Passed over, the message went back to the
    buffer, and that wait, already open, never looked there again: it waited with its message buffered.
    Now it is delivered to that wait without the instance's row, which the holder never waits for."""
    gate["k-busy"] = asyncio.Event(), (go_on := asyncio.Event())
    try:
        async with open_engine(database_url, Registry(looped), concurrency=4) as engine:
            c = engine.client
            first, second, running = await _second_waits_while_first_skips(engine, "k-busy", 5)
            async with _row_held(database_url, second):
                go_on.set()
                # The first ends; its message's command is rejected and handed on in that commit. (The
                # second's commit taking it waits for this transaction: not awaited here.)
                assert (await c.wait_for(first)).status == "COMPLETED"
                row = await conn.fetchrow("SELECT status, deliveries FROM stepstone.messages")
                assert row["status"] == "DELIVERED", row
            await running
            await engine.run_until_idle()
            assert (await c.get(first)).state["got"] == [["skip", 0]]
            info = await c.get(second)
            assert (info.status, info.state["got"]) == ("COMPLETED", [["m", 5]]), info
    finally:
        gate.pop("k-busy", None)


# A wait that a signal leaves for another wait, each step a pure decision (no handler), so that a test can
# claim, decide and commit each command itself.
crossed = Workflow("crossed", version=1)
crossed.wait("await_m", messages={"m": "after"}, signals={"skip": "after"}, correlation="k", start=True)
crossed.wait("after", signals={"done": END})


async def test_a_group_commit_hands_messages_on_in_key_order(
    database_url: str, conn: asyncpg.Connection, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A commit that settles a buffered message's command untaken hands the message on under its key's lock.
    Grouped, each item took its key as it came, in instance order, and held it while the group went on to
    its later items' rows: two groups [A (key k2), B (k1)] and [C (k1), D (k2)] closed a cycle on the keys,
    PostgreSQL aborted one (40P01 after deadlock_timeout) and the worker committed its items one by one.
    Now a commit hands its messages on after all its items, in (name, key) order."""
    async with open_engine(database_url, Registry(crossed), concurrency=1) as engine:
        c, store = engine.client, engine.store
        ids: list[str] = []
        ids_in_start_order(monkeypatch, 4)
        for n, key in enumerate(("k2", "k1", "k1", "k2")):
            await c.publish_message("m", key, {"n": n}, ttl=600, message_id=f"x-{n}")
            ids.append(await c.start(crossed, {"k": key}))
            await c.signal(ids[-1], "skip", {})  # queued before the wait takes the message

        async def decided(kind: str) -> dict[str, CommitRequest]:
            claims = {claim.instance.id: claim for claim in await store.claim(8, 30, "grouper")}
            assert set(claims) == set(ids) and {cl.command.kind for cl in claims.values()} == {kind}, claims
            out = {}
            for iid, claim in claims.items():
                decision = apply(claim.instance, claim.command, crossed.plan, claim.now)
                assert isinstance(decision, Decision), decision
                out[iid] = CommitRequest(claim, claim.command.id, decision, claim.instance.visit,
                                         claim.instance.state_version)
            return out

        for kind in ("START", "SIGNAL"):  # the wait takes its message; the skip leaves the wait
            for request in (await decided(kind)).values():
                assert await store.commit(request, lease_seconds=30, worker="grouper") is not None
        returned = await decided("MESSAGE")
        a, b, cc, d = (returned[iid] for iid in sorted(ids))
        assert [r.claim.command.payload["correlation_key"] for r in (a, b, cc, d)] == ["k2", "k1", "k1", "k2"]
        assert all(r.decision.settle.state == "STALE" for r in (a, b, cc, d))
        caplog.set_level(logging.WARNING, logger="stepstone.worker")
        results = await commit_crossed(store, database_url, conn, (a, b, cc, d))
        assert all(r is not None for r in results), results
        assert [r.getMessage() for r in caplog.records if "DeadlockDetected" in r.getMessage()] == []
        # No wait of either key is open: each message went back to the buffer.
        assert await conn.fetchval("SELECT count(*) FROM stepstone.messages WHERE status = 'BUFFERED'") == 4


async def test_a_message_given_to_a_busy_instance_that_is_cancelled_goes_on(
    database_url: str, conn: asyncpg.Connection,
) -> None:
    """Given to a busy instance's open wait without its row, the message's command can meet what that
    instance's holder does next: here the holder cancels it. The cancel settles the command CANCELLED, and
    the message goes on, back to the buffer, where the next wait of its key finds it."""
    gate["k-gone-busy"] = asyncio.Event(), (go_on := asyncio.Event())
    try:
        async with open_engine(database_url, Registry(looped), concurrency=4) as engine:
            c = engine.client
            first, second, running = await _second_waits_while_first_skips(engine, "k-gone-busy", 6)
            async with _row_held(database_url, second) as holder:
                go_on.set()
                assert (await c.wait_for(first)).status == "COMPLETED"
                assert await conn.fetchval("SELECT status FROM stepstone.messages") == "DELIVERED"
                await holder.execute("SELECT stepstone.cancel_tree($1::uuid, 'test', 'test', false)", second)
            await running
            assert (await c.get(second)).status == "CANCELLED"
            assert await conn.fetchval("SELECT state FROM stepstone.commands WHERE kind = 'MESSAGE' "
                                       "AND instance_id = $1::uuid", second) == "CANCELLED"
            assert await conn.fetchval("SELECT status FROM stepstone.messages") == "BUFFERED"
            third = await c.start(looped, {"k": "k-gone-busy"})
            await engine.run_until_idle()
            info = await c.get(third)
            assert (info.status, info.state["got"]) == ("COMPLETED", [["m", 6]]), info
    finally:
        gate.pop("k-gone-busy", None)


async def test_a_message_whose_instance_is_cancelled_before_applying_it_goes_on(
    database_url: str, conn: asyncpg.Connection,
) -> None:
    """An operator's cancel settles the instance's open commands CANCELLED (settle_open_commands), the
    message's one too, which the hand-on did not count as left untaken: the message stayed DELIVERED to
    the cancelled instance, and the open wait of its key never got it."""
    gate["k-cancel"] = asyncio.Event(), (go_on := asyncio.Event())
    try:
        async with open_engine(database_url, Registry(looped), concurrency=4, lease_seconds=600) as engine:
            c = engine.client
            first, second, running = await _second_waits_while_first_skips(engine, "k-cancel", 8)
            await c.cancel(first, "changed my mind")  # while the skip's step runs, its message queued behind
            go_on.set()
            await running
            await engine.run_until_idle()
            assert (await c.get(first)).status == "CANCELLED"
            info = await c.get(second)
            assert (info.status, info.state["got"]) == ("COMPLETED", [["m", 8]]), info
    finally:
        gate.pop("k-cancel", None)


# A race of a message wait (branch a, key `k`) against a signal (branch b); the join then waits for a message
# of key `j`. The signal's commit wins the race: it cancels branch a, whose message command is still open,
# and enters the wait of key `j`, all in one commit.
raced = Workflow("raced", version=1)
raced.fork("split", branches={"a": "await_k", "b": "await_win"}, start=True)
raced.wait("await_k", messages={"m": "merge"}, correlation="k")
raced.wait("await_win", signals={"win": "merge"})
raced.join("merge", fork="split", need="any", next="await_j")
raced.wait("await_j", messages={"m": END}, correlation="j")


async def test_a_commit_that_hands_on_and_subscribes_takes_its_keys_in_one_order(
    database_url: str, conn: asyncpg.Connection,
) -> None:
    """A lone commit that both hands a message on and opens a subscription took its Subscribe keys in the
    subscriptions section and its hand-on keys at its end: two sorted batches. X (hands on k1, subscribes
    k2) took k2 then k1, Y (hands on k2, subscribes k1) k1 then k2: with k1 held elsewhere until both wait
    for it, Y got k1 and waited for k2, X held k2 and waited for k1, and PostgreSQL aborted one (40P01).
    Now a commit takes its Subscribe and hand-on keys together, in (name, key) order."""
    async with open_engine(database_url, Registry(raced), concurrency=1) as engine:
        c, store = engine.client, engine.store
        x = await c.start(raced, {"k": "k1", "j": "k2"})
        y = await c.start(raced, {"k": "k2", "j": "k1"})
        for n, key in enumerate(("k1", "k2")):
            await c.publish_message("m", key, {"n": n}, ttl=600)

        async def claimed() -> list[CommitRequest]:
            out = []
            for claim in await store.claim(8, 30, "racer"):
                decision = apply(claim.instance, claim.command, raced.plan, claim.now)
                assert isinstance(decision, Decision), decision
                out.append(CommitRequest(claim, claim.command.id, decision, claim.instance.visit,
                                         claim.instance.state_version))
            return out

        held = set()  # the messages' commands, claimed and never applied: the signal's commit wins the race
        for _ in range(3):  # the fork, then its branches (branch a takes its key's buffered message)
            for request in await claimed():
                if request.claim.command.kind == "MESSAGE":
                    held.add(request.claim.instance.id)
                    continue
                committed = await store.commit(request, lease_seconds=30, worker="racer")
                assert committed is not None and not committed.conflict, committed
        assert held == {x, y}
        for iid in (x, y):
            await c.signal(iid, "win", {}, position="split/b")
        for request in await claimed():  # branch b ends; its report to the join is queued on the root
            assert request.claim.command.kind == "SIGNAL", request
            assert await store.commit(request, lease_seconds=30, worker="racer") is not None
        # The join's commit: it cancels branch a (its message's command settled CANCELLED: handed on) and
        # enters the wait of `j` (a Subscribe): both in one commit, which commits alone.
        ready = {request.claim.instance.id: request for request in await claimed()}
        assert {r.claim.command.kind for r in ready.values()} == {"BRANCH_DONE"} and set(ready) == {x, y}, ready
        holder = await asyncpg.connect(database_url)
        try:
            async with holder.transaction():
                await holder.execute("SELECT stepstone.lock_correlation('m', 'k1')")
                second = asyncio.ensure_future(store.commit(ready[y], lease_seconds=30, worker="racer"))
                await until_blocked(conn, holder, 1, every=0.02, timeout=10,
                                    failure="Y's commit never came to wait for key k1")
                first = asyncio.ensure_future(store.commit(ready[x], lease_seconds=30, worker="racer"))
                await until_blocked(conn, holder, 2, every=0.02, timeout=10,
                                    failure="X's commit never came to wait")
            results = await asyncio.wait_for(asyncio.gather(first, second, return_exceptions=True), timeout=30)
        finally:
            await holder.close()
        assert [type(r).__name__ for r in results if r is None or isinstance(r, BaseException)] == []
        # Y committed first: its message went back to the buffer, where X's new wait of k2 took it; X's went
        # on to Y's new wait of k1.
        await engine.run_until_idle()
        assert [(await c.get(iid)).status for iid in (x, y)] == ["COMPLETED", "COMPLETED"]
        rows = await conn.fetch("SELECT correlation_key, status, deliveries->0->>'instance_id' AS taker "
                                "FROM stepstone.messages ORDER BY correlation_key")
        assert [tuple(r) for r in rows] == [("k1", "DELIVERED", y), ("k2", "DELIVERED", x)]
