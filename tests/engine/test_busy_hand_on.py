"""A buffered message handed on to an open wait whose instance's row another transaction holds (migration 0077,
`instance_busy`), when that holder is the instance's own commit leaving the wait or ending the instance, against
real PostgreSQL. Each commit is claimed, decided and committed by the test; the holder's commit is the store's
own statement, run in a transaction of another connection that took the instance's row first."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from stepstone.authoring.workflow import END, Registry, Workflow
from stepstone.core.model import Decision
from stepstone.core.transitions import apply
from stepstone.store.port import CommitRequest
from stepstone.store.postgres import _document, _init_connection
from stepstone.testing import open_engine

# A message wait a signal (`skip`) or its timeout leaves for a wait for `done`, or a signal (`stop`) ends the
# instance from. Pure decisions, no handler.
busy = Workflow("busyhand", version=1)
busy.wait("await_m", messages={"m": "after"}, signals={"skip": "after", "stop": END}, correlation="k", start=True,
          timeout=3600, on_timeout="after")
busy.wait("after", signals={"done": END})


async def _decided(store: Any, kinds: dict[str, str]) -> dict[str, CommitRequest]:
    """The queue heads claimed, `kinds` naming each one's instance and kind; decided, not committed."""
    claims = {cl.instance.id: cl for cl in await store.claim(8, 30, "tester")}
    assert {iid: cl.command.kind for iid, cl in claims.items()} == kinds, claims
    out = {}
    for iid, claim in claims.items():
        decision = apply(claim.instance, claim.command, busy.plan, claim.now)
        assert isinstance(decision, Decision), decision
        out[iid] = CommitRequest(claim, claim.command.id, decision, claim.instance.visit, claim.instance.state_version)
    return out


async def _commit(store: Any, request: CommitRequest) -> None:
    assert await store.commit(request, lease_seconds=30, worker="tester") is not None


@contextlib.asynccontextmanager
async def _commit_holding_row(database_url: str, request: CommitRequest, isolation: str) -> AsyncIterator[None]:
    """The commit of `request` in a transaction of another connection that takes its instance's row first (as
    commit_decisions does) and carries the rest of the commit out when the block ends."""
    holder = await asyncpg.connect(database_url)
    try:
        await _init_connection(holder)
        async with holder.transaction(isolation=isolation):
            await holder.execute("SELECT 1 FROM stepstone.instances WHERE id = $1::uuid FOR UPDATE",
                                 request.claim.instance.id)
            yield
            rows = await holder.fetch("SELECT idx, outcome FROM stepstone.commit_decisions($1)",
                                      [_document(request, 30, "tester")])
            assert [r["outcome"] for r in rows] == ["ok"], rows  # not fenced out, not a conflict
    finally:
        await holder.close()


async def _hand_on_while_held(engine: Any, conn: asyncpg.Connection, database_url: str, key: str, leave: str,
                              isolation: str, origin: str) -> tuple[str, str]:
    """Message `m` of `key` taken from the buffer by A's wait (`origin` buffered), or published straight to it
    (`origin` straight, migration 0087), which a `skip` queued first leaves; B waits for `key`, and `leave` (a
    signal's name, or `timeout`: its wait's timer made due) is queued for it. A's message command goes STALE and
    hands the message on while B's commit of `leave` holds B's row: B's wait gets it without the row. Returns
    A's and B's ids once B's commit is done."""
    c, store = engine.client, engine.store
    if origin == "buffered":
        await c.publish_message("m", key, {"n": 7}, ttl=600, message_id=f"{key}-m")
    a = await c.start(busy, {"k": key})
    if origin == "buffered":
        await c.signal(a, "skip", {})
    await _commit(store, (await _decided(store, {a: "START"}))[a])  # A's wait (takes the message, skip first)
    if origin == "straight":
        await c.signal(a, "skip", {})
        published = await c.publish_message("m", key, {"n": 7}, ttl=600, message_id=f"{key}-m")
        assert [d.instance_id for d in published.deliveries] == [a], published
    b = await c.start(busy, {"k": key})
    heads = await _decided(store, {a: "SIGNAL", b: "START"})
    await _commit(store, heads[b])  # B's wait: nothing buffered
    if leave == "timeout":
        await conn.execute("UPDATE stepstone.commands SET available_at = stepstone.db_now() "
                           "WHERE kind = 'TIMER' AND instance_id = $1::uuid", b)
    else:
        await c.signal(b, leave, {})
    leaving = (await _decided(store, {b: "TIMER" if leave == "timeout" else "SIGNAL"}))[b]
    await _commit(store, heads[a])  # A leaves its wait
    async with _commit_holding_row(database_url, leaving, isolation):
        returned = (await _decided(store, {a: "MESSAGE"}))[a]
        assert returned.decision.settle.state == "STALE"
        await _commit(store, returned)
        row = await conn.fetchrow("SELECT status, deliveries->0->>'instance_id' AS instance FROM stepstone.messages")
        assert (row["status"], row["instance"]) == ("DELIVERED", b), row
        assert await conn.fetchval("SELECT payload ? 'instance_busy' FROM stepstone.commands WHERE kind = 'MESSAGE' "
                                   "AND instance_id = $1::uuid", b)
    return a, b


async def _next_wait_gets_it(engine: Any, conn: asyncpg.Connection, key: str) -> str:
    """A wait of `key` opened now takes the message from the buffer and applies it."""
    assert await conn.fetchval("SELECT status FROM stepstone.messages") == "BUFFERED"
    third = await engine.client.start(busy, {"k": key})
    await engine.run_until_idle()
    info = await engine.client.get(third)
    assert (info.status, info.step) == ("WAITING", "after"), info
    correlated = await conn.fetch("SELECT instance_id::text AS instance, data->>'message_id' AS message_id "
                                  "FROM stepstone.history WHERE kind = 'MESSAGE_CORRELATED'")
    assert [(r["instance"], r["message_id"]) for r in correlated] == [(third, f"{key}-m")], correlated
    row = await conn.fetchrow("SELECT status, ARRAY(SELECT d->>'instance_id' FROM jsonb_array_elements(deliveries) "
                              "AS d) AS instances FROM stepstone.messages")
    assert (row["status"], row["instances"]) == ("DELIVERED", [third]), row
    return third


async def _message_commands(conn: asyncpg.Connection, instance: str) -> list[tuple[str, str | None]]:
    rows = await conn.fetch("SELECT state, last_error FROM stepstone.commands WHERE kind = 'MESSAGE' "
                            "AND instance_id = $1::uuid ORDER BY id", instance)
    return [(r["state"], r["last_error"]) for r in rows]


@pytest.mark.parametrize("origin", ["buffered", "straight"])
@pytest.mark.parametrize("leave", ["skip", "timeout"])
async def test_a_message_handed_to_a_busy_wait_its_own_commit_leaves_goes_on(
    database_url: str, conn: asyncpg.Connection, leave: str, origin: str,
) -> None:
    """The holder of B's row is B's commit of a signal, or of its wait's timeout, that leaves the wait. The
    message handed on meanwhile to that wait (read open as last committed) comes after it: its command finds
    the wait left, goes STALE (MESSAGE_RETURNED in B's history) and hands the message on again, back to the
    buffer, where the next wait of its key takes it. B never applies it."""
    async with open_engine(database_url, Registry(busy), concurrency=1) as engine:
        a, b = await _hand_on_while_held(engine, conn, database_url, "k-left", leave, "read_committed", origin)
        assert (await engine.client.get(b)).step == "after"
        stale = (await _decided(engine.store, {b: "MESSAGE"}))[b]
        assert stale.decision.settle.state == "STALE", stale.decision
        await _commit(engine.store, stale)
        assert [state for state, _ in await _message_commands(conn, b)] == ["STALE"]
        assert await conn.fetchval("SELECT count(*) FROM stepstone.history WHERE instance_id = $1::uuid "
                                   "AND kind = 'MESSAGE_RETURNED'", b) == 1
        await _next_wait_gets_it(engine, conn, "k-left")
        for iid in (a, b):
            info = await engine.client.get(iid)
            assert (info.status, info.step) == ("WAITING", "after"), info


@pytest.mark.parametrize("origin", ["buffered", "straight"])
async def test_a_message_handed_to_a_busy_instance_ended_unseen_is_rejected_at_its_claim_and_goes_on(
    database_url: str, conn: asyncpg.Connection, origin: str,
) -> None:
    """The holder of B's row is B's commit ending it (a `stop` signal), whose statement settling the instance's
    leftover commands ran before the handed-on command was committed (a repeatable-read snapshot here: the
    same view). The command is left PENDING on the ended instance; its claim rejects it (INSTANCE_ENDED) and
    the message goes on, back to the buffer, where the next wait of its key takes it."""
    async with open_engine(database_url, Registry(busy), concurrency=1) as engine:
        _, b = await _hand_on_while_held(engine, conn, database_url, "k-ended", "stop", "repeatable_read", origin)
        assert (await engine.client.get(b)).status == "COMPLETED"
        assert await _message_commands(conn, b) == [("PENDING", None)]
        await engine.run_until_idle()
        assert await _message_commands(conn, b) == [("REJECTED", "INSTANCE_ENDED")]
        await _next_wait_gets_it(engine, conn, "k-ended")


@pytest.mark.parametrize("origin", ["buffered", "straight"])
async def test_a_message_handed_to_a_busy_instance_its_commit_ends_seeing_it_goes_on(
    database_url: str, conn: asyncpg.Connection, origin: str,
) -> None:
    """The same ending commit reading the handed-on command (its statement after the hand-on's commit): it
    rejects the command with the instance's other leftovers, and the message goes on in that commit."""
    async with open_engine(database_url, Registry(busy), concurrency=1) as engine:
        _, b = await _hand_on_while_held(engine, conn, database_url, "k-seen", "stop", "read_committed", origin)
        assert (await engine.client.get(b)).status == "COMPLETED"
        assert await _message_commands(conn, b) == [("REJECTED", "INSTANCE_ENDED")]
        await _next_wait_gets_it(engine, conn, "k-seen")
