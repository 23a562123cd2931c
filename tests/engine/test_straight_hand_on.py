"""A message published straight to an open wait (answered `delivered`) that the instance leaves before applying
it (a signal queued before it, the wait's timeout, a cancel) goes on as a buffered one does (migration 0087): to
the next open wait of its name and key, else to the buffer until its ttl (without a ttl: dropped), and is applied
once. Against real PostgreSQL."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from stepstone.authoring.workflow import END, Registry, Workflow
from stepstone.testing import open_engine

# A message wait a signal (`skip`) or its timeout leaves for a wait for `done`. Pure decisions, no handler.
straight = Workflow("straighthand", version=1)
straight.wait("await_m", messages={"m": "after"}, signals={"skip": "after"}, correlation="k", start=True,
              timeout=3600, on_timeout="after")
straight.wait("after", signals={"done": END})


async def _waiting(engine: Any, key: str) -> str:
    iid = await engine.client.start(straight, {"k": key})
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).step == "await_m"
    return str(iid)


async def _publish(engine: Any, key: str, ttl: float | None, to: str) -> None:
    """Published while `to`'s wait is open: delivered to it straight."""
    published = await engine.client.publish_message("m", key, {"n": 1}, message_id=f"{key}-m", ttl=ttl)
    assert (published.outcome, [d.instance_id for d in published.deliveries]) == ("delivered", [to]), published


async def _applied_by(conn: asyncpg.Connection) -> list[str]:
    rows = await conn.fetch("SELECT instance_id::text AS i FROM stepstone.history WHERE kind = 'MESSAGE_CORRELATED'")
    return [r["i"] for r in rows]


async def _message(conn: asyncpg.Connection) -> tuple[str, list[str]]:
    row = await conn.fetchrow("SELECT status, ARRAY(SELECT d->>'instance_id' FROM jsonb_array_elements(deliveries) "
                              "AS d) AS instances FROM stepstone.messages")
    return row["status"], list(row["instances"])


async def _left_untaken(conn: asyncpg.Connection, first: str) -> None:
    """The first instance never applied it: its command settled, not parked."""
    states = await conn.fetch("SELECT state FROM stepstone.commands WHERE kind = 'MESSAGE' AND instance_id = $1::uuid",
                              first)
    assert [r["state"] for r in states] in (["STALE"], ["CANCELLED"]), states


async def _leave(engine: Any, first: str, how: str) -> None:
    """The first leaves its wait before applying the message: the skip queued before it, or its due timeout,
    is run first; or it is cancelled."""
    if how == "cancel":
        await engine.client.cancel(first, "changed my mind")
    await engine.run_until_idle()


@pytest.mark.parametrize("how", ["signal", "timeout", "cancel"])
@pytest.mark.parametrize("ttl", [600, None])
async def test_the_next_open_wait_of_the_key_takes_it(database_url: str, conn: asyncpg.Connection,
                                                       how: str, ttl: float | None) -> None:
    """Two waits of the key; the message goes straight to the older, which a signal queued before it, its due
    timeout or a cancel leaves: the other open wait takes it and applies it, once."""
    async with open_engine(database_url, Registry(straight), concurrency=2) as engine:
        key = f"k-{how}"
        first = await _waiting(engine, key)
        if how == "timeout":
            await engine.move_clock(3601)  # the first's timeout is due, not yet fired: its wait is open
        second = await _waiting(engine, key) if how != "timeout" else None
        if how == "signal":
            await engine.client.signal(first, "skip", {})
        await _publish(engine, key, ttl, first)
        if how == "timeout":  # its start runs the first's timeout too
            second = await _waiting_or_moved(engine, key)
        assert second is not None
        await _leave(engine, first, how)
        assert (await engine.client.get(second)).step == "after"
        assert await _applied_by(conn) == [second]
        assert await _message(conn) == ("DELIVERED", [second])
        await _left_untaken(conn, first)
        kinds = [e["kind"] for e in await engine.client.history(first)]
        assert "MESSAGE_PARKED" not in kinds, kinds


@pytest.mark.parametrize("how", ["signal", "timeout", "cancel"])
async def test_with_no_open_wait_it_is_buffered_for_the_next(database_url: str, conn: asyncpg.Connection,
                                                             how: str) -> None:
    """No other wait of the key is open when the first leaves: the message is buffered until its expires_at,
    and the next wait of the key takes it from there, once."""
    async with open_engine(database_url, Registry(straight), concurrency=2) as engine:
        key = f"b-{how}"
        first = await _waiting(engine, key)
        if how == "timeout":
            await engine.move_clock(3601)
        if how == "signal":
            await engine.client.signal(first, "skip", {})
        await _publish(engine, key, 600, first)
        await _leave(engine, first, how)
        assert await _message(conn) == ("BUFFERED", [])
        await _left_untaken(conn, first)
        nxt = await _waiting_or_moved(engine, key)
        assert (await engine.client.get(nxt)).step == "after"
        assert await _applied_by(conn) == [nxt]
        assert await _message(conn) == ("DELIVERED", [nxt])


async def _waiting_or_moved(engine: Any, key: str) -> str:
    iid = await engine.client.start(straight, {"k": key})
    await engine.run_until_idle()
    return str(iid)


async def test_without_a_ttl_and_no_open_wait_it_is_dropped(database_url: str, conn: asyncpg.Connection) -> None:
    """Published with no ttl, it is kept for no later wait: with no other wait open when the first leaves, it is
    dropped, as a publish that finds no open wait is, and the next wait of the key does not get it."""
    async with open_engine(database_url, Registry(straight), concurrency=2) as engine:
        first = await _waiting(engine, "d-1")
        await engine.client.signal(first, "skip", {})
        await _publish(engine, "d-1", None, first)
        await engine.run_until_idle()
        assert await _message(conn) == ("DROPPED", [])
        await _left_untaken(conn, first)
        nxt = await _waiting(engine, "d-1")
        assert await _applied_by(conn) == []
        assert (await engine.client.get(nxt)).step == "await_m"


async def test_a_message_published_to_every_wait_stays_parked(database_url: str, conn: asyncpg.Connection) -> None:
    """With correlate_all the message went to every wait open at its publish: a wait that is left before it
    applies its copy parks that copy (each other wait had its own), as before; no later wait gets it."""
    async with open_engine(database_url, Registry(straight), concurrency=2) as engine:
        first = await _waiting(engine, "a-1")
        second = await _waiting(engine, "a-1")
        await engine.client.signal(first, "skip", {})
        published = await engine.client.publish_message("m", "a-1", {"n": 1}, ttl=600, correlate_all=True)
        assert sorted(d.instance_id for d in published.deliveries) == sorted([first, second])
        await engine.run_until_idle()
        assert await _applied_by(conn) == [second]
        states = await conn.fetch("SELECT state FROM stepstone.commands WHERE kind = 'MESSAGE' "
                                  "AND instance_id = $1::uuid", first)
        assert [r["state"] for r in states] == ["PARKED"], states
        third = await _waiting(engine, "a-1")
        assert await _applied_by(conn) == [second]
        assert (await engine.client.get(third)).step == "await_m"


# The same wait with a step deadline of a minute, which leaves it for `after`.
timed = Workflow("straightdeadline", version=1)
timed.wait("await_m", messages={"m": "after"}, correlation="k", start=True, deadline=60, on_deadline="after")
timed.wait("after", signals={"done": END})


async def test_a_wait_its_step_deadline_left_hands_it_on(database_url: str, conn: asyncpg.Connection) -> None:
    """The wait's deadline passed (its timer due, not yet fired) when the message was published to it: the
    deadline leaves the wait first, and the next wait of the key takes the message."""
    async with open_engine(database_url, Registry(timed), concurrency=2) as engine:
        first = await engine.client.start(timed, {"k": "s-1"})
        await engine.run_until_idle()
        await engine.move_clock(61)
        await _publish(engine, "s-1", 600, first)
        await engine.run_until_idle()
        assert (await engine.client.get(first)).step == "after"
        await _left_untaken(conn, first)
        nxt = await engine.client.start(timed, {"k": "s-1"})
        await engine.run_until_idle()
        assert (await engine.client.get(nxt)).step == "after"
        assert await _applied_by(conn) == [nxt]
