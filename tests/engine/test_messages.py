"""Correlated messages, buffering, start_or_signal and timeouts held back, against real PostgreSQL."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.cli.instances import describe_wait
from stepstone.core.effects import Subscribe
from stepstone.core.model import Decision
from stepstone.core.timestamps import MAX_SECONDS
from stepstone.core.transitions import apply
from stepstone.errors import (
    IdempotencyConflict,
    InvalidInput,
    InvalidState,
    OpenSignalLimit,
    Unavailable,
    UnknownSignal,
)
from stepstone.store import postgres_tasks
from stepstone.store.port import CommitRequest
from stepstone.testing import Engine, open_engine
from tests._pg import until_blocked
from tests.crashes import die_alone
from tests.engine.crossed_groups import commit_crossed, ids_in_start_order
from tests.engine.task_workflows import Receipt, keyed, receipt, registry, two_waits


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, registry, concurrency=4, lease_seconds=30, max_claims=3) as e:
        yield e


async def _waiting(engine: Engine, order_id: str) -> str:
    iid = await engine.client.start(receipt, Receipt(order_id=order_id))
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).step == "await_receipt"
    return iid


async def test_a_message_goes_to_the_open_subscription(engine: Engine) -> None:
    iid = await _waiting(engine, "o-1")
    # The key the wait subscribed with was nowhere to see (only in the subscriptions table): a message
    # published under another spelling of it went unexplained.
    waiting = await engine.client.get(iid)
    assert waiting.waiting_for["correlation_key"] == "o-1"
    assert "message receipt_received (key o-1)" in describe_wait(waiting)
    [entry] = [e for e in await engine.client.history(iid) if e["kind"] == "WAITING"]
    assert entry["data"]["correlation_key"] == "o-1"
    published = await engine.client.publish_message("receipt_received", "o-1", {"n": 1}, message_id="m-1")
    assert published.outcome == "delivered"
    assert [d.instance_id for d in published.deliveries] == [iid]
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.state["via"], info.state["got"]) == ("COMPLETED", "receipt_received", "1")
    again = await engine.client.publish_message("receipt_received", "o-1", {"n": 1}, message_id="m-1")
    assert again.duplicate and again.outcome == "delivered" and again.deliveries == published.deliveries
    with pytest.raises(IdempotencyConflict):
        await engine.client.publish_message("receipt_received", "o-1", {"n": 2}, message_id="m-1")


async def test_no_subscription_buffers_with_a_ttl_and_drops_without(engine: Engine, conn: asyncpg.Connection) -> None:
    dropped = await engine.client.publish_message("receipt_received", "o-2", {"n": 0})
    assert (dropped.outcome, dropped.deliveries, dropped.expires_at) == ("dropped", [], None)
    first = await engine.client.publish_message("receipt_received", "o-2", {"n": 1}, ttl=60)
    second = await engine.client.publish_message("receipt_received", "o-2", {"n": 2}, ttl=60)
    assert first.outcome == second.outcome == "buffered" and first.expires_at is not None
    iid = await engine.client.start(receipt, Receipt(order_id="o-2"))
    await engine.run_until_idle()  # first in, first out: the older buffered message is delivered on entering
    info = await engine.client.get(iid)
    assert (info.status, info.state["got"]) == ("COMPLETED", "1")
    statuses = [r["status"] for r in await conn.fetch("SELECT status FROM stepstone.messages ORDER BY id")]
    assert statuses == ["DROPPED", "DELIVERED", "BUFFERED"]
    # An expired buffered message is not delivered.
    await engine.client.publish_message("receipt_received", "o-3", {"n": 3}, ttl=5)
    await engine.move_clock(6)
    late = await _waiting(engine, "o-3")
    assert (await engine.client.get(late)).status == "WAITING"


async def test_a_ttl_no_timestamp_holds_is_refused(engine: Engine) -> None:
    """An infinite ttl once reached the server ("interval out of range")."""
    for ttl in (float("inf"), 1e300, float("nan"), -1.0):
        with pytest.raises(InvalidInput, match="ttl must be a number of seconds from 0 to a thousand years"):
            await engine.client.publish_message("receipt_received", "o-ttl", {"n": 1}, ttl=ttl)


async def test_a_ttl_under_a_microsecond_is_refused(engine: Engine, conn: asyncpg.Connection) -> None:
    """A ttl under a microsecond answered "buffered" with an expires_at no later than the publish: a message
    no wait could ever take. It is refused, and nothing is kept; a microsecond is buffered until after now."""
    for ttl in (1e-7, 4e-7, 9.99e-7):
        with pytest.raises(InvalidInput, match="under a microsecond"):
            await engine.client.publish_message("receipt_received", "o-tiny", {"n": 1}, ttl=ttl, message_id="t-1")
    assert await conn.fetchval("SELECT count(*) FROM stepstone.messages") == 0
    kept = await engine.client.publish_message("receipt_received", "o-tiny", {"n": 1}, ttl=1e-6)
    assert kept.outcome == "buffered" and kept.expires_at is not None
    assert await conn.fetchval("SELECT expires_at > created_at FROM stepstone.messages")
    assert (await engine.client.publish_message("receipt_received", "o-tiny", {"n": 2}, ttl=0)).outcome == "dropped"


async def test_the_database_refuses_a_ttl_under_a_microsecond_too(engine: Engine, conn: asyncpg.Connection) -> None:
    """Only the client refused it: the store's publish, and the SQL function the caller's transaction
    calls, buffered it with an expires_at no later than the publish. Both refuse it (InvalidInput), and
    the caller's transaction stays usable."""
    store = engine.client.store
    with pytest.raises(InvalidInput, match="under a microsecond"):
        await store.publish_message("receipt_received", "o-tiny", {"n": 1}, message_id=None, ttl=1e-7,
                                    correlate_all=False, fingerprint="f")
    async with conn.transaction():
        with pytest.raises(InvalidInput, match="under a microsecond"):
            await engine.client._caller_transaction(conn).publish_in(
                conn, "receipt_received", "o-tiny", {"n": 2}, message_id=None, ttl=9.99e-7, correlate_all=False,
                fingerprint="f")
        assert await conn.fetchval("SELECT count(*) FROM stepstone.messages") == 0  # still usable
    assert await conn.fetchval("SELECT count(*) FROM stepstone.messages") == 0


async def test_the_database_refuses_every_ttl_the_client_refuses(engine: Engine, conn: asyncpg.Connection) -> None:
    """A NaN, infinite or too long ttl reaching the SQL function failed with "interval out of range" (22008),
    unmapped, and a negative one was answered `dropped`, where the client refuses all of them. The store's
    publish and the caller's-transaction path refuse them as the client does, the transaction still usable;
    a thousand years exactly is kept."""
    store = engine.client.store
    refused = (float("nan"), float("inf"), float("-inf"), -1.0, -1e-9, MAX_SECONDS * 2, 1e300)
    for ttl in refused:
        with pytest.raises(InvalidInput, match="ttl must be a number of seconds from 0 to a thousand years"):
            await store.publish_message("receipt_received", "o-bad", {"n": 1}, message_id=None, ttl=ttl,
                                        correlate_all=False, fingerprint="f")
    async with conn.transaction():
        for ttl in refused:
            with pytest.raises(InvalidInput, match="ttl must be a number of seconds from 0 to a thousand years"):
                await engine.client._caller_transaction(conn).publish_in(
                    conn, "receipt_received", "o-bad", {"n": 2}, message_id=None, ttl=ttl, correlate_all=False,
                    fingerprint="f")
        assert await conn.fetchval("SELECT count(*) FROM stepstone.messages") == 0  # still usable
    assert await conn.fetchval("SELECT count(*) FROM stepstone.messages") == 0
    longest = await store.publish_message("receipt_received", "o-bad", {"n": 3}, message_id=None, ttl=MAX_SECONDS,
                                          correlate_all=False, fingerprint="f")
    assert longest["status"] == "BUFFERED"


async def test_the_oldest_subscription_wins_and_correlate_all_reaches_every_one(engine: Engine) -> None:
    older = await _waiting(engine, "shared")
    newer = await _waiting(engine, "shared")
    one = await engine.client.publish_message("receipt_received", "shared", {"n": 1})
    assert [d.instance_id for d in one.deliveries] == [older]
    third = await _waiting(engine, "shared")
    every = await engine.client.publish_message("receipt_received", "shared", {"n": 2}, correlate_all=True)
    assert sorted(d.instance_id for d in every.deliveries) == sorted([newer, third])
    await engine.run_until_idle()
    for iid in (older, newer, third):
        assert (await engine.client.get(iid)).status == "COMPLETED"


async def test_two_concurrent_messages_to_one_wait_lose_nothing(engine: Engine, conn: asyncpg.Connection) -> None:
    iid = await _waiting(engine, "o-4")
    answers = await asyncio.gather(
        *(engine.client.publish_message("receipt_received", "o-4", {"n": n}, ttl=300) for n in range(2)))
    assert sorted(a.outcome for a in answers) == ["buffered", "delivered"]
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"
    # The second one waits, buffered, for the next subscription of that key.
    nxt = await engine.client.start(receipt, Receipt(order_id="o-4"))
    await engine.run_until_idle()
    assert (await engine.client.get(nxt)).status == "COMPLETED"
    got = {(await engine.client.get(i)).state["got"] for i in (iid, nxt)}
    assert got == {"0", "1"}
    assert await conn.fetchval("SELECT count(*) FROM stepstone.messages WHERE status = 'DELIVERED'") == 2


async def test_publish_racing_subscription_creation_is_delivered_exactly_once(
    engine: Engine, conn: asyncpg.Connection,
) -> None:
    for n in range(12):
        key = f"race-{n}"
        iid = await engine.client.start(receipt, Receipt(order_id=key))
        published, _ = await asyncio.gather(
            engine.client.publish_message("receipt_received", key, {"n": n}, ttl=300), engine.run_until_idle())
        await engine.run_until_idle()
        info = await engine.client.get(iid)
        assert info.status == "COMPLETED", (n, published)
        delivered = await conn.fetchval(
            "SELECT count(*) FROM stepstone.commands WHERE instance_id = $1 AND kind = 'MESSAGE'", info.id)
        assert delivered == 1
        assert await conn.fetchval("SELECT count(*) FROM stepstone.messages WHERE correlation_key = $1 "
                                   "AND status = 'BUFFERED'", key) == 0


async def test_a_timeout_waits_for_a_signal_recorded_before_it(engine: Engine) -> None:
    iid = await _waiting(engine, "o-5")
    await engine.client.signal(iid, "skip", {"n": 5})
    await engine.move_clock(timedelta(minutes=11))  # the timeout is due too, but the signal came first
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.state["via"], info.state["got"]) == ("skip", "5")

    late = await _waiting(engine, "o-6")
    await engine.move_clock(timedelta(minutes=11))
    await engine.client.signal(late, "skip", {"n": 6})  # after the fire time: the timeout wins
    await engine.run_until_idle()
    assert (await engine.client.get(late)).state["via"] == "timeout"


async def test_a_parked_signal_holds_no_timeout_back(engine: Engine, conn: asyncpg.Connection) -> None:
    iid = await engine.client.start(two_waits, {})
    await engine.run_until_idle()
    await engine.client.signal(iid, "later", {})  # for the second wait: it parks, out of the first's queue
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).step == "first"
    assert await conn.fetchval("SELECT state FROM stepstone.commands WHERE kind = 'SIGNAL'") == "PARKED"
    await engine.move_clock(timedelta(minutes=11))  # the first wait's timeout fires, then the parked signal applies
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.state["via"]) == ("COMPLETED", "later")


async def test_a_dead_lettered_signal_holds_no_timeout_back(engine: Engine, conn: asyncpg.Connection) -> None:
    iid = await engine.client.start(two_waits, {})
    await engine.run_until_idle()
    await engine.client.signal(iid, "go", {})  # for the first wait: recorded before its timeout
    # Workers claim it and die before committing (their leases run out): once, then max_claims (3) times alone.
    assert {claim.command.kind for claim in await die_alone(engine)} == {"SIGNAL"}
    await engine.run_until_idle()  # the next claim finds max_claims alone spent: the signal is dead-lettered
    assert await conn.fetchval("SELECT state FROM stepstone.commands WHERE kind = 'SIGNAL'") == "DEAD"
    assert (await engine.client.get(iid)).step == "first"  # a dead signal does not fail the wait
    await engine.move_clock(timedelta(minutes=10))  # past the timeout: the dead signal holds nothing back
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.step) == ("WAITING", "second")
    kinds = [h["kind"] for h in await engine.client.history(iid)]
    assert "COMMAND_DEAD_LETTERED" in kinds and "SIGNAL_APPLIED" not in kinds


async def test_the_open_signal_cap_is_1000_by_default(engine: Engine, conn: asyncpg.Connection) -> None:
    iid = await _waiting(engine, "o-cap-default")
    assert await conn.fetchval("SELECT current_setting('stepstone.max_open_signals', true)") in (None, "")
    recorded = await conn.fetchval(
        "SELECT count(*) FROM generate_series(1, 1000) AS n, "
        "LATERAL stepstone.signal_position($1::uuid, '', 'skip', NULL, 'd' || n, 'f', NULL)", iid)
    assert recorded == 1000
    with pytest.raises(OpenSignalLimit) as refused:
        await engine.client.signal(iid, "skip", {"n": 1001}, dedup_key="one-more")
    assert refused.value.limit == 1000
    assert await conn.fetchval("SELECT count(*) FROM stepstone.dedup WHERE key = 'one-more'") == 0
    assert await conn.fetchval("SELECT count(*) FROM stepstone.commands WHERE kind = 'SIGNAL'") == 1000


async def test_a_message_after_the_wait_was_left_is_not_delivered_to_it(engine: Engine) -> None:
    iid = await _waiting(engine, "o-7")
    await engine.client.signal(iid, "skip", {"n": 7})
    await engine.run_until_idle()
    answer = await engine.client.publish_message("receipt_received", "o-7", {"n": 8})
    assert answer.outcome == "dropped"


async def test_start_or_signal_starts_one_instance(engine: Engine, conn: asyncpg.Connection) -> None:
    results = await asyncio.gather(*(
        engine.client.start_or_signal(receipt, "bk-1", "skip", {"n": n}, input=Receipt(order_id="bk-1"),
                                      dedup_key=f"s-{n}")
        for n in range(4)))
    assert sum(r.started for r in results) == 1
    assert len({r.instance_id for r in results}) == 1
    assert await conn.fetchval("SELECT count(*) FROM stepstone.instances WHERE business_key = 'bk-1'") == 1
    await engine.run_until_idle()
    info = await engine.client.get(results[0].instance_id)
    assert info.status == "COMPLETED" and info.state["via"] == "skip"
    with pytest.raises(InvalidState):
        await engine.client.start_or_signal(receipt, "bk-1", "skip", {"n": 9}, input=Receipt(order_id="bk-1"))
    with pytest.raises(InvalidState):  # ended: refused as ended, not for the input it does not need
        await engine.client.start_or_signal(receipt, "bk-1", "skip", {"n": 9})
    with pytest.raises(InvalidInput, match="order_id"):  # none has the key: this call would start it
        await engine.client.start_or_signal(receipt, "bk-2", "skip", {"n": 9})
    assert await conn.fetchval("SELECT count(*) FROM stepstone.instances WHERE business_key = 'bk-2'") == 0
    # A signal the workflow does not declare is the same error as for an instance (it was a bare InvalidInput)
    with pytest.raises(UnknownSignal, match=r"workflow 'receipt' v1 has no signal named 'nope' \(it declares "):
        await engine.client.start_or_signal(receipt, "bk-3", "nope", {}, input=Receipt(order_id="bk-3"))


async def test_an_instance_holds_at_most_the_open_signal_cap(engine: Engine, conn: asyncpg.Connection) -> None:
    await conn.execute("SELECT set_config('stepstone.max_open_signals', '3', false)")  # this session only
    iid = await _waiting(engine, "o-cap")
    await conn.execute("SELECT stepstone.signal_position($1::uuid, '', 'skip', NULL, 'a', 'f', NULL)", iid)
    await conn.execute("SELECT stepstone.signal_position($1::uuid, '', 'skip', NULL, 'b', 'f', NULL)", iid)
    await conn.execute("SELECT stepstone.signal_position($1::uuid, '', 'skip', NULL, 'c', 'f', NULL)", iid)
    with pytest.raises(asyncpg.PostgresError) as refused:
        await conn.execute("SELECT stepstone.signal_position($1::uuid, '', 'skip', NULL, 'd', 'f', NULL)", iid)
    assert refused.value.sqlstate == "SC429"
    assert await conn.fetchval("SELECT count(*) FROM stepstone.dedup WHERE key = 'd'") == 0
    assert await conn.fetchval("SELECT count(*) FROM stepstone.commands WHERE kind = 'SIGNAL'") == 3


async def test_the_cap_is_a_typed_error_on_the_client(database_url: str, conn: asyncpg.Connection) -> None:
    name = await conn.fetchval("SELECT current_database()")
    await conn.execute(f'ALTER DATABASE "{name}" SET stepstone.max_open_signals = 5')  # new sessions see it
    async with open_engine(database_url, registry, concurrency=1) as engine:
        iid = await _waiting(engine, "o-cap2")
        for n in range(5):
            await engine.client.signal(iid, "skip", {"n": n})
        with pytest.raises(OpenSignalLimit) as refused:
            await engine.client.signal(iid, "skip", {"n": 5}, dedup_key="over")
        assert refused.value.limit == 5 and refused.value.instance_id == iid
        assert await conn.fetchval("SELECT count(*) FROM stepstone.dedup WHERE key = 'over'") == 0
        for n in range(5):  # buffered messages of one name and key are capped the same way
            await engine.client.publish_message("receipt_received", "nobody-waits", {"n": n}, ttl=60)
        with pytest.raises(OpenSignalLimit) as full:
            await engine.client.publish_message("receipt_received", "nobody-waits", {"n": 5}, ttl=60,
                                                message_id="m-over")
        assert full.value.limit == 5, "the buffer's refusal names its cap, as the instance's does"
        assert "5 messages are buffered for this name and key" in str(full.value)
        caller = await asyncpg.connect(database_url)  # the caller's own transaction (a new session: cap 5)
        try:
            async with caller.transaction():
                with pytest.raises(OpenSignalLimit) as full_in:
                    await engine.client.publish_message("receipt_received", "nobody-waits", {"n": 6}, ttl=60,
                                                        connection=caller)
        finally:
            await caller.close()
        assert full_in.value.limit == 5
        assert await conn.fetchval("SELECT count(*) FROM stepstone.messages WHERE message_id = 'm-over'") == 0
        await engine.run_until_idle()  # they drain: one moves the wait, the rest park
        info = await engine.client.get(iid)
        assert info.status == "COMPLETED"


async def test_a_correlation_key_longer_than_an_index_holds_fails_the_instance(engine: Engine) -> None:
    """The subscription's key is indexed: one of 6,000 characters failed the wait's commit on every claim."""
    iid = await engine.client.start(receipt, Receipt(order_id=secrets.token_hex(3000)))
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "FAILED"
    assert info.error is not None and info.error["type"] == "InvalidCorrelation"


async def test_a_key_that_is_not_text_is_its_json_text_on_both_sides(engine: Engine) -> None:
    """A boolean state value subscribed as `True` (Python's str), which a JSON client publishing `true`
    never matched; a map as `{'a': 1}`. Now the wait's key and a publish's are one JSON text."""
    values = [True, False, 7, 2.5, {"b": 1, "a": [1, "x"]}]
    ids = [await engine.client.start(keyed, {"key": v}) for v in values]
    await engine.run_until_idle()
    texts = ["true", "false", "7", "2.5", '{"a":[1,"x"],"b":1}']
    assert [(await engine.client.get(i)).waiting_for["correlation_key"] for i in ids] == texts
    # True as text (a JSON client's or the CLI's `true`), False from Python, 7 and 2.5 from Python, the map as text.
    for key in ("true", False, 7, 2.5, '{"a":[1,"x"],"b":1}'):
        published = await engine.client.publish_message("keyed", key)
        assert published.outcome == "delivered", key
    await engine.run_until_idle()
    assert [(await engine.client.get(i)).status for i in ids] == ["COMPLETED"] * len(ids)
    with pytest.raises(InvalidInput, match="has no JSON text"):
        await engine.client.publish_message("keyed", float("nan"))


async def test_an_integral_number_is_one_key_whatever_its_type(engine: Engine) -> None:
    """A float state field holding 2.0 subscribed as `2.0`, which a JSON client's 2 (or "2") never met, nor
    a Python int 2; and 2 in the state never met a publish of 2.0. An integral number's key is now the
    integer's text on both sides, in a map too."""
    values = [2.0, 2, 2.0, -0.0, 1e16, {"n": 3.0}, 2.5]
    ids = [await engine.client.start(keyed, {"key": v}) for v in values]
    await engine.run_until_idle()
    texts = ["2", "2", "2", "0", "10000000000000000", '{"n":3}', "2.5"]
    assert [(await engine.client.get(i)).waiting_for["correlation_key"] for i in ids] == texts
    for key in (2, 2.0, 0, 10**16, {"n": 3}, 2.5):  # a map is published as its text (`key` below)
        published = await engine.client.publish_message("keyed", key if not isinstance(key, dict) else '{"n":3}')
        assert published.outcome == "delivered", key
    # and the text "2", a JSON client's string or the CLI's typed key
    assert (await engine.client.publish_message("keyed", "2")).outcome == "delivered"
    await engine.run_until_idle()
    assert [(await engine.client.get(i)).status for i in ids] == ["COMPLETED"] * len(ids)


async def test_a_repeated_start_or_signal_says_it_started_the_instance(engine: Engine) -> None:
    """The repeat of a call (the same dedup key, after a lost answer) answered started=False although its
    first attempt had started the instance."""
    first = await engine.client.start_or_signal(receipt, "bk-r", "skip", {"n": 1}, input=Receipt(order_id="bk-r"),
                                                dedup_key="call-1")
    again = await engine.client.start_or_signal(receipt, "bk-r", "skip", {"n": 1}, input=Receipt(order_id="bk-r"),
                                                dedup_key="call-1")
    other = await engine.client.start_or_signal(receipt, "bk-r", "skip", {"n": 2}, input=Receipt(order_id="bk-r"),
                                                dedup_key="call-2")
    assert (first.started, again.started, other.started) == (True, True, False)
    assert again.instance_id == first.instance_id and again.command_id == first.command_id
    assert (await engine.client.start_or_signal(receipt, "bk-r", "skip", {"n": 2}, input=Receipt(order_id="bk-r"),
                                                dedup_key="call-2")).started is False


async def test_a_repeat_without_its_input_says_it_started_the_instance_too(engine: Engine) -> None:
    """A repeat of the call that started the instance (its dedup key) without its input, or with one no longer
    valid, goes the signal-only path, which answered started=False: the caller that retried after a lost
    answer was told its own call had not started the instance."""
    first = await engine.client.start_or_signal(receipt, "bk-n", "skip", {"n": 1}, input=Receipt(order_id="bk-n"),
                                                dedup_key="call-1")
    bare = await engine.client.start_or_signal(receipt, "bk-n", "skip", {"n": 1}, dedup_key="call-1")
    wrong = await engine.client.start_or_signal(receipt, "bk-n", "skip", {"n": 1}, input={"order_id": 5},
                                                dedup_key="call-1")
    assert (first.started, bare.started, wrong.started) == (True, True, True)
    assert {bare.command_id, wrong.command_id} == {first.command_id}  # the same signal, recorded once
    # Another call (another key) only signals it, and so does one without a dedup key: neither started it
    other = await engine.client.start_or_signal(receipt, "bk-n", "skip", {"n": 2}, dedup_key="call-2")
    assert other.started is False and other.command_id != first.command_id
    assert (await engine.client.start_or_signal(receipt, "bk-n", "skip", {"n": 2}, dedup_key="call-2")).started is False
    assert (await engine.client.start_or_signal(receipt, "bk-n", "skip", {"n": 3})).started is False


async def test_an_ended_instance_is_refused_in_the_same_words_on_both_paths(engine: Engine) -> None:
    """With an input to start it and without one (an instance that has the key needs none), an ended
    instance was refused in two wordings."""
    done = await engine.client.start_or_signal(receipt, "bk-e", "skip", {}, input=Receipt(order_id="bk-e"))
    await engine.run_until_idle()
    messages = []
    for given in (Receipt(order_id="bk-e"), None):
        with pytest.raises(InvalidState) as refused:
            await engine.client.start_or_signal(receipt, "bk-e", "skip", {"n": 9}, input=given)
        messages.append(str(refused.value))
    words = (f"instance {done.instance_id} with business key 'bk-e' is COMPLETED; it takes no more signals "
             "(a business key stays with its instance)")
    assert messages == [words, words]


async def test_one_message_id_published_at_once_under_two_names_is_a_conflict(
    engine: Engine, database_url: str,
) -> None:
    """A message id names one message whatever its name and key, but two publishes of one id took the
    locks of their own (name, key) only: the one that came second waited on the first's row and then
    failed on the unique index (asyncpg's UniqueViolationError, an HTTP 500), where a publish after the
    first's commit is told IdempotencyConflict. Publishes of one id now serialize on the id."""
    first, watcher = await asyncpg.connect(database_url), await asyncpg.connect(database_url)
    try:
        held = first.transaction()
        await held.start()
        kept = await engine.client.publish_message("receipt_received", "o-a", {"n": 1}, message_id="m-twice",
                                                   ttl=60, connection=first)
        assert kept.outcome == "buffered"
        second = asyncio.ensure_future(
            engine.client.publish_message("other_name", "o-b", {"n": 1}, message_id="m-twice", ttl=60))
        await until_blocked(watcher, first, failure="the second publish never waited for the first")
        assert not second.done()
        await held.commit()
        with pytest.raises(IdempotencyConflict, match="m-twice"):
            await second
        same = await engine.client.publish_message("receipt_received", "o-a", {"n": 1}, message_id="m-twice", ttl=60)
        assert same.duplicate and same.outcome == "buffered"
    finally:
        await first.close()
        await watcher.close()


async def test_a_group_commit_never_takes_a_correlation_lock_before_another_instance(
    engine: Engine, database_url: str, conn: asyncpg.Connection, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A commit that enters a wait taking messages locks the correlation key (after its instance row, the
    lock order). Grouped with a later instance's commit, it held that key while it waited for the later
    instance's row: two groups [A (key k2), B (key k1)] and [C (k1), D (k2)] closed a cycle on the keys,
    PostgreSQL aborted one (40P01 after deadlock_timeout) and the worker committed its items one by one.
    A subscribing commit now goes alone (committer.py), as a child's does, so no group holds a key."""
    ids_in_start_order(monkeypatch, 4)
    ids = [await engine.client.start(keyed, {"key": key}) for key in ("k2", "k1", "k1", "k2")]
    claims = {c.instance.id: c for c in await engine.store.claim(8, 30, "grouper")}
    assert set(claims) == set(ids), claims
    requests = []
    for iid in ids:
        claim = claims[iid]
        decision = apply(claim.instance, claim.command, keyed.plan, claim.now)
        assert isinstance(decision, Decision) and any(isinstance(e, Subscribe) for e in decision.effects)
        requests.append(CommitRequest(claim, claim.command.id, decision, claim.instance.visit,
                                      claim.instance.state_version))
    a, b, c, d = requests
    assert [r.claim.instance.id for r in requests] == sorted(ids)  # each group's order is its ids' order
    caplog.set_level(logging.WARNING, logger="stepstone.worker")
    results = await commit_crossed(engine.store, database_url, conn, (a, b, c, d))
    assert all(r is not None for r in results), results
    # An aborted group is committed one by one, so every commit lands either way: the worker's warning
    # says a group was aborted (PostgreSQL's deadlock count is flushed late, so it is not looked at).
    assert [r.getMessage() for r in caplog.records if "DeadlockDetected" in r.getMessage()] == []
    assert await conn.fetchval("SELECT count(*) FROM stepstone.subscriptions WHERE status = 'OPEN'") == 4


# A message buffered for a wait the instance reaches while it holds as many open signals as it may.
held_back = Workflow("held_back", version=1)
held_back.timer("pause", delay=10, next="await_m", start=True)
held_back.wait("await_m", messages={"m": "await_other"}, correlation="k")
held_back.wait("await_other", signals={"other": "closing"})


@held_back.step(next=None)
async def closing(ctx: StepContext, state: dict[str, Any]) -> None:
    state["done"] = True


async def test_a_buffered_message_reaches_its_wait_whatever_the_instance_holds(
    database_url: str, conn: asyncpg.Connection,
) -> None:
    """The open-signal cap refuses what arrives from outside. A message buffered before its wait opened had
    arrived already (and counted against its key's buffer), but the commit that enters the wait and takes
    it recorded its MESSAGE command through the same capped trigger: an instance at its cap (here 1, a
    parked signal for a later wait) failed that commit, "segment crashed: ... holds 1 open signals and
    messages", claim after claim. Taking a buffered message is now not counted as an arrival."""
    name = await conn.fetchval("SELECT current_database()")
    await conn.execute(f'ALTER DATABASE "{name}" SET stepstone.max_open_signals = 1')  # new sessions see it
    async with open_engine(database_url, Registry(held_back), concurrency=1, max_claims=2) as engine:
        iid = await engine.client.start(held_back, {"k": "k-held"})
        await engine.run_until_idle()
        await engine.client.signal(iid, "other", {"n": 1})  # parked: the instance is at the pause
        assert (await engine.client.publish_message("m", "k-held", {"n": 2}, ttl=600)).outcome == "buffered"
        with pytest.raises(OpenSignalLimit):  # the cap still holds for what comes from outside
            await engine.client.signal(iid, "other", {"n": 3})
        await engine.move_clock(11)
        await engine.run_until_idle()
        info = await engine.client.get(iid)
        assert (info.status, info.state.get("done")) == ("COMPLETED", True), info
    assert await conn.fetchval("SELECT status FROM stepstone.messages") == "DELIVERED"


async def test_a_publish_that_keeps_meeting_a_busy_instance_is_refused_after_about_ten_seconds(
    engine: Engine, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every attempt refused (SQLSTATE 55P03, an instance busy whenever it is met): the client tries 200 times,
    backing off from 2 ms to 50 ms, about ten seconds in all (the docs said five), then refuses the publish
    Unavailable, having published nothing (each attempt is one statement, undone whole)."""
    attempts: list[str] = []
    waited: list[float] = []
    real_sleep = asyncio.sleep

    async def busy(name: str, *args: Any) -> Any:
        attempts.append(name)
        raise asyncpg.LockNotAvailableError("could not obtain lock on row in relation \"instances\"")

    async def sleep(delay: float) -> None:
        waited.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(engine.store, "_task_row", busy)
    monkeypatch.setattr(postgres_tasks.asyncio, "sleep", sleep)
    with pytest.raises(Unavailable, match="nothing was published"):
        await engine.client.publish_message("receipt_received", "busy", {"n": 1}, correlate_all=True)
    assert (len(attempts), set(attempts)) == (200, {"publish_message"})
    assert 9.5 < sum(waited) < 10.5, sum(waited)


async def test_a_publish_to_every_subscription_waits_for_a_busy_instance(
    engine: Engine, database_url: str, conn: asyncpg.Connection,
) -> None:
    """publish_message took each matching instance's row NOWAIT under the key's lock, so one busy instance
    failed the attempt and the client began again: with correlate_all, every attempt had to find every
    matching instance idle at once, and to many busy ones the client's five seconds of tries ran out
    (Unavailable). Now the rows are taken first, waiting for a busy one as a signal does; here one stays
    busy (its row held by another transaction) while the publish waits, then it delivers to all."""
    ids = [await _waiting(engine, "busy") for _ in range(3)]
    holder = await asyncpg.connect(database_url)
    try:
        held = holder.transaction()
        await held.start()
        await holder.execute("SELECT 1 FROM stepstone.instances WHERE id = $1::uuid FOR UPDATE", ids[1])
        every = asyncio.ensure_future(
            engine.client.publish_message("receipt_received", "busy", {"n": 1}, correlate_all=True))
        await until_blocked(conn, holder, timeout=10, failure="the publish never waited for the busy instance")
        assert not every.done()
        await held.commit()
        published = await every
    finally:
        await holder.close()
    assert sorted(d.instance_id for d in published.deliveries) == sorted(ids)
    await engine.run_until_idle()
    assert [(await engine.client.get(i)).status for i in ids] == ["COMPLETED"] * 3


async def test_a_publish_waits_for_the_oldest_open_wait_not_a_stale_subscription(
    engine: Engine, database_url: str, conn: asyncpg.Connection,
) -> None:
    """A subscription stays open after its wait is left until a publish finds it stale: the rows a publish
    waits for are those of waits still open, so here the busy younger wait's, not the left one's."""
    left = await _waiting(engine, "stale")
    await engine.client.signal(left, "skip", {"n": 0})
    await engine.run_until_idle()
    waiting = await _waiting(engine, "stale")
    holder = await asyncpg.connect(database_url)
    try:
        held = holder.transaction()
        await held.start()
        await holder.execute("SELECT 1 FROM stepstone.instances WHERE id = $1::uuid FOR UPDATE", waiting)
        one = asyncio.ensure_future(engine.client.publish_message("receipt_received", "stale", {"n": 1}))
        await until_blocked(conn, holder, timeout=10, failure="the publish never waited for the busy instance")
        await held.commit()
        published = await one
    finally:
        await holder.close()
    assert [d.instance_id for d in published.deliveries] == [waiting]
