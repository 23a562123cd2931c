"""The outbox queries on their own: claim order and hold-back, leases, the fence, counts, retention guard."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

import asyncpg
import pytest

from stepstone.outbox.publisher import Outcome, PublishResult
from stepstone.outbox.relay import Relay, RelayConfig, settlements
from stepstone.store.outbox import PostgresOutbox, Settlement, StagedEvent
from stepstone.store.postgres import PostgresStore
from tests.outbox.conftest import claim, first_claim, stage


async def test_claim_is_staged_order_and_holds_a_key_behind_what_it_did_not_take(
    conn: asyncpg.Connection, outbox: PostgresOutbox
) -> None:
    staged = await stage(conn, ["a", "b", "a", None, "a", None])
    ids = [i for i, _, _ in staged]
    _, first = await claim(outbox, limit=3)
    assert first == ids[:3]
    # a's third event is beyond that claim's limit and a's older ones are leased elsewhere: held back.
    # Unkeyed events ask for no order and are taken.
    _, second = await claim(outbox, relay="other")
    assert second == [ids[3], ids[5]]


async def test_a_lease_expires_and_a_wrong_token_settles_nothing(
    conn: asyncpg.Connection, store: PostgresStore, outbox: PostgresOutbox
) -> None:
    staged = await stage(conn, ["a", "a"])
    token, ids = await claim(outbox)
    assert ids == [i for i, _, _ in staged]
    assert (await claim(outbox, some=False))[1] == []
    assert await outbox.settle(uuid.uuid4(), [Settlement(ids[0], "published")]) == set()
    await store.move_clock(31)
    late, again = await claim(outbox)
    assert again == ids
    assert await outbox.settle(token, [Settlement(i, "published") for i in ids]) == set(), "fenced out"
    assert await outbox.settle(late, [Settlement(i, "published") for i in ids]) == set(ids)
    assert (await outbox.status()).pending == 0


async def test_rows_staged_before_the_migration_have_no_xid_and_are_claimed(
    conn: asyncpg.Connection, outbox: PostgresOutbox
) -> None:
    staged = await stage(conn, ["a"])
    await conn.execute("UPDATE stepstone.outbox SET xid = NULL")
    assert (await claim(outbox))[1] == [staged[0][0]]


async def test_status_counts_and_lag(conn: asyncpg.Connection, store: PostgresStore, outbox: PostgresOutbox) -> None:
    empty = await outbox.status()
    assert (empty.pending, empty.dead, empty.lag_seconds) == (0, 0, None)
    staged = await stage(conn, ["a", "b", "c"])
    await store.move_clock(5)
    token, ids = await claim(outbox, limit=2)
    await outbox.settle(token, [Settlement(ids[0], "dead", "refused: no"), Settlement(ids[1], "retry", "x", 60)])
    status = await outbox.status()
    assert (status.pending, status.dead, status.backing_off, status.in_flight) == (2, 1, 1, 0)
    assert status.lag_seconds is not None and status.lag_seconds >= 5
    assert staged[2][0] in [r.id for r in await outbox.unpublished()]


async def test_requeue_all_dead(conn: asyncpg.Connection, outbox: PostgresOutbox) -> None:
    await stage(conn, ["a", "b"])
    token, ids = await claim(outbox)
    await outbox.settle(token, [Settlement(i, "dead", "refused", counted=True) for i in ids])
    assert [d.attempts for d in await outbox.unpublished(dead=True)] == [1, 1]
    assert await outbox.requeue(all_dead=True) == ids
    assert await outbox.requeue(all_dead=True) == []
    assert [r.attempts for r in await outbox.unpublished()] == [0, 0]
    assert (await claim(outbox))[1] == ids


async def test_retention_guard_names_instances_with_unpublished_or_dead_events(
    conn: asyncpg.Connection, outbox: PostgresOutbox
) -> None:
    sent, pending, dead, quiet = (uuid.uuid4() for _ in range(4))
    [(to_send, _, _)] = await stage(conn, ["s"], instance=sent)
    [(to_bury, _, _)] = await stage(conn, ["d"], instance=dead)
    # Two claims when another test's transaction on a shared server began between the two stages: a claim
    # takes only rows below the visibility horizon (see conftest.py `claim`), so the first took one alone.
    taken: dict[int, uuid.UUID] = {}
    while len(taken) < 2:
        token, ids = await claim(outbox)
        assert ids, "the staged events became claimable"
        taken.update(dict.fromkeys(ids, token))
    await outbox.settle(taken[to_send], [Settlement(to_send, "published")])
    await outbox.settle(taken[to_bury], [Settlement(to_bury, "dead", "refused")])
    await stage(conn, ["p"], instance=pending)
    everyone = [str(i) for i in (sent, pending, dead, quiet)]
    assert await outbox.unsent_instances(everyone) == {str(pending), str(dead)}
    assert await outbox.unsent_instances() == {str(pending), str(dead)}
    assert await outbox.unsent_instances([str(sent), str(quiet)]) == set()


def test_settlements_mark_each_keys_acknowledged_prefix() -> None:
    now = datetime.now(UTC)
    batch = [StagedEvent(n, f"e{n}", "i", "t", key, None, now, attempts=att)
             for n, (key, att) in enumerate([("a", 0), ("b", 0), ("a", 0), (None, 0), ("b", 9), ("a", 0)], 1)]
    ok, late = PublishResult.OK, PublishResult.transient("timeout")
    results = [ok, PublishResult.refused("no"), late, late, ok, ok]
    plan = settlements(batch, results, RelayConfig(max_attempts=10, retry_base=1))
    assert [(s.id, s.action, s.counted) for s in plan] == [
        (1, "published", False),  # a's prefix
        (2, "dead", True),  # refused for good
        (3, "retry", True),  # a's first failure: counted, backs off 1 s
        (4, "retry", True),  # unkeyed: on its own
        (5, "release", False),  # b stopped at 2: not marked even though the broker took it
        (6, "release", False),  # a stopped at 3
    ]
    assert plan[2].delay == 1.0
    tenth = settlements(batch[4:5], [late], RelayConfig(max_attempts=10))
    assert (tenth[0].action, tenth[0].error) == ("dead", "failed 10 times: timeout")
    unreachable = settlements(batch[:1], [PublishResult.transient("down", attempted=False)], RelayConfig())
    assert (unreachable[0].action, unreachable[0].counted) == ("release", False)
    assert Outcome.OK is ok.outcome


async def test_keys_held_back_do_not_starve_the_keys_behind_them(
    conn: asyncpg.Connection, outbox: PostgresOutbox
) -> None:
    """A dead event (or a key leased elsewhere) with a batch's worth of its key's events behind it made
    every claim come back empty: the claim's limit was spent on the held-back events, so no later key
    was ever published and the relay took the outbox for idle."""
    staged = await stage(conn, ["a", "a", "a", "b", "b", "b", "c", None])
    ids = [i for i, _, _ in staged]
    token, first = await claim(outbox, limit=1)
    assert first == ids[:1]
    await outbox.settle(token, [Settlement(ids[0], "dead", "refused: no", counted=True)])
    _, leased = await claim(outbox, limit=1, relay="other")
    assert leased == [ids[3]], "a waits behind its dead event; b's first is taken"
    _, rest = await claim(outbox, limit=2)
    assert rest == ids[6:], "a behind its dead event and b behind its lease use up no part of the limit"


async def test_a_relay_counts_only_what_its_settle_recorded(
    conn: asyncpg.Connection, store: PostgresStore, outbox: PostgresOutbox, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch whose lease ran out while it was published, and which another relay took over, is settled by
    nobody here (the fence): the relay still counted it published and logged its dead letters as made."""
    staged = await stage(conn, ["a", "b"])

    class TakenOver:
        name = "taken-over://"

        async def publish(self, batch: Sequence[StagedEvent]) -> list[PublishResult]:
            await store.move_clock(31)  # the lease runs out; another relay takes the batch over
            assert (await claim(outbox, relay="other"))[1] == [e.id for e in batch] == [i for i, _, _ in staged]
            return [PublishResult.OK, PublishResult.refused("poison")]

        async def close(self) -> None:
            return None

    relay = Relay(outbox, TakenOver(), RelayConfig())
    with caplog.at_level(logging.WARNING, "stepstone.relay"):
        assert await first_claim(relay) == 0
    assert (relay.events.published, relay.events.dead) == (0, 0)
    assert "dead-lettered" not in caplog.text
    assert "taken over" in caplog.text
    assert [r.claimed_by for r in await outbox.unpublished()] == ["other", "other"], "left to the relay holding it"
