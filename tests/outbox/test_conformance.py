"""The publisher conformance suite: the same assertions against every broker and the in-memory one.

Each test stages events straight into the outbox table (as step commits do), runs relays against
the broker kind of its parameter, and reads back what the broker holds.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import asyncpg

from stepstone.outbox.publisher import Publisher, PublishResult, open_publisher
from stepstone.outbox.relay import Relay, RelayConfig
from stepstone.store.outbox import PostgresOutbox, StagedEvent
from stepstone.store.postgres import PostgresStore
from tests.outbox.brokers import Kind, Seen, TcpProxy, with_port
from tests.outbox.conftest import first_claim, past_the_horizon, publish_until, stage

ROOT = Path(__file__).resolve().parents[2]


def per_key_first(seen: list[Seen]) -> dict[str | None, list[str]]:
    """Each key's event ids in the order the broker first holds them (a republish is not a new place)."""
    order: dict[str | None, list[str]] = {}
    first: set[str] = set()
    for event_id, key, _ in seen:
        if event_id not in first:
            first.add(event_id)
            order.setdefault(key, []).append(event_id)
    return order


def expected_per_key(staged: list[tuple[int, str, str | None]]) -> dict[str | None, list[str]]:
    order: dict[str | None, list[str]] = {}
    for _, event_id, key in sorted(staged):
        order.setdefault(key, []).append(event_id)
    return order


def assert_keys_in_order(seen: list[Seen], staged: list[tuple[int, str, str | None]]) -> None:
    got = per_key_first(seen)
    want = expected_per_key(staged)
    for key, ids in want.items():
        if key is None:
            assert sorted(got.get(None, [])) == sorted(ids)
        else:
            assert got.get(key) == ids, f"key {key}: broker order differs from staged order"


async def drain(relays: Sequence[Relay], outbox: PostgresOutbox) -> None:
    """Run the relays side by side until a round finds nothing and nothing is pending (a round that finds
    nothing while events are pending waits for a foreign transaction holding the horizon: `past_the_horizon`)."""
    async def rounds() -> int:
        while any(await asyncio.gather(*(r.run_until_idle() for r in relays))):
            pass
        return (await outbox.status()).pending

    if await past_the_horizon(rounds, lambda pending: pending == 0):
        raise AssertionError(f"still pending: {await outbox.status()}")


async def test_every_event_arrives_with_its_id_and_trace_context(kind: Kind, conn: asyncpg.Connection,
                                                                 outbox: PostgresOutbox) -> None:
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    staged = await stage(conn, ["k1", "k2", "k1", None], trace=trace)
    publisher = open_publisher(kind.url)
    try:
        published = await publish_until(Relay(outbox, publisher), 4)
    finally:
        await publisher.close()
    assert published == 4
    seen = await kind.read()
    assert sorted(e for e, _, _ in seen) == sorted(e for _, e, _ in staged)
    assert {t for _, _, t in seen} == {trace}
    assert_keys_in_order(seen, staged)
    status = await outbox.status()
    assert (status.pending, status.dead) == (0, 0)


async def test_a_key_reaches_the_broker_as_it_was_or_not_in_a_header(kind: Kind, conn: asyncpg.Connection,
                                                                   outbox: PostgresOutbox) -> None:
    """Where a broker's headers cannot carry a key as it is, the publisher leaves it out of them (the
    envelope has it) rather than send another key: NATS's client trimmed ` sp ` to `sp` and turned a line
    break into a space, so a consumer reading `stepstone-key` got a key no event has."""
    keys = [" sp ", "a\nb", "café", "plain"]
    staged = await stage(conn, keys)
    publisher = open_publisher(kind.url)
    try:
        assert await publish_until(Relay(outbox, publisher), len(keys)) == len(keys)
    finally:
        await publisher.close()
    given = {event_id: key for _, event_id, key in staged}
    seen = {event_id: key for event_id, key, _ in await kind.read()}
    assert seen.keys() == given.keys()
    assert {e: k for e, k in seen.items() if k is not None and k != given[e]} == {}, "a key other than the event's"
    assert seen[next(e for e, k in given.items() if k == "plain")] == "plain"


class Gated:
    """Holds each publish until `release` is set, after signalling `entered`."""

    def __init__(self, inner: Publisher) -> None:
        self.inner = inner
        self.name = inner.name
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def publish(self, batch: Sequence[StagedEvent]) -> list[PublishResult]:
        self.entered.set()
        await self.release.wait()
        return await self.inner.publish(batch)

    async def close(self) -> None:
        await self.inner.close()


async def test_several_relays_keep_per_key_order(kind: Kind, conn: asyncpg.Connection, store: PostgresStore,
                                                 outbox: PostgresOutbox) -> None:
    keys = [f"k{n % 8}" for n in range(96)] + [None] * 8
    staged = await stage(conn, keys)
    held = Gated(open_publisher(kind.url))
    publishers: list[Publisher] = [held, open_publisher(kind.url), open_publisher(kind.url)]
    relays = [Relay(PostgresOutbox(store), p, RelayConfig(batch_size=7, relay_id=f"r{i}"))
              for i, p in enumerate(publishers)]
    try:
        # The first relay holds its first batch (the first event of each of k0..k6) on its way to the
        # broker, so the work is shared whatever the scheduling: another relay publishes what its claims
        # find unblocked (k7's first event: the next candidates are all behind the held batch) before
        # the three drain the rest side by side.
        first = asyncio.create_task(first_claim(relays[0]))
        await held.entered.wait()
        assert await publish_until(relays[1], 1) > 0
        held.release.set()
        await first
        await drain(relays, outbox)
    finally:
        for p in publishers:
            await p.close()
    assert sum(r.events.published for r in relays) == len(staged)
    seen = await kind.read()
    assert Counter(e for e, _, _ in seen) == Counter(e for _, e, _ in staged)
    assert_keys_in_order(seen, staged)


async def test_a_relay_never_overtakes_another_on_a_key(kind: Kind, conn: asyncpg.Connection,
                                                       outbox: PostgresOutbox) -> None:
    staged = await stage(conn, ["a", "b", "a", "b", None, "c", "a", None])
    slow, fast = Gated(open_publisher(kind.url)), open_publisher(kind.url)
    try:
        first = asyncio.create_task(first_claim(Relay(outbox, slow, RelayConfig(batch_size=3, relay_id="slow"))))
        await slow.entered.wait()  # a, b, a leased and on their way
        other = Relay(outbox, fast, RelayConfig(relay_id="fast"))
        await publish_until(other, 3)
        # Everything of keys a and b waits for the slow relay; the rest went.
        assert sorted(e for e, _, _ in await kind.read()) == sorted(e for _, e, k in staged if k not in ("a", "b"))
        slow.release.set()
        assert await first == 3
        await drain([other], outbox)
    finally:
        await slow.close()
        await fast.close()
    seen = await kind.read()
    assert Counter(e for e, _, _ in seen) == Counter(e for _, e, _ in staged)
    assert_keys_in_order(seen, staged)


async def test_a_relay_killed_between_publish_and_mark_publishes_again(
    kind: Kind, conn: asyncpg.Connection, database_url: str, store: PostgresStore, outbox: PostgresOutbox
) -> None:
    staged = await stage(conn, [f"k{n % 3}" for n in range(12)])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.outbox.crash_relay", database_url, kind.url, "5",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
        assert line, "the relay process published nothing"
        sent_by_doomed = json.loads(line)
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.communicate()
    assert len(sent_by_doomed) == 5
    status = await outbox.status()
    assert (status.pending, status.in_flight) == (12, 5), "published but never marked: still leased"
    await store.move_clock(601)  # the dead relay's lease expires
    publisher = open_publisher(kind.url)
    try:
        assert await publish_until(Relay(outbox, publisher), 12) == 12
    finally:
        await publisher.close()
    seen = await kind.read()
    if kind.memory is not None:  # the killed process's broker was its own memory: take its word
        seen = [(e, k, None) for _, e, k in staged if e in sent_by_doomed] + seen
    counts = Counter(e for e, _, _ in seen)
    assert set(counts) == {e for _, e, _ in staged}, "at least once: nothing lost"
    again = 1 if kind.dedups else 2
    assert {counts[e] for e in sent_by_doomed} == {again}
    assert {counts[e] for _, e, _ in staged if e not in sent_by_doomed} == {1}
    assert_keys_in_order(seen, staged)


class HalfAccepted:
    """The broker acknowledges only the first half of each batch: the rest is never sent."""

    def __init__(self, inner: Publisher) -> None:
        self.inner = inner
        self.name = inner.name

    async def publish(self, batch: Sequence[StagedEvent]) -> list[PublishResult]:
        half = len(batch) // 2
        results = await self.inner.publish(batch[:half])
        return [*results, *[PublishResult.transient("no acknowledgement")] * (len(batch) - half)]

    async def close(self) -> None:
        await self.inner.close()


async def test_a_batch_the_broker_half_accepts(kind: Kind, conn: asyncpg.Connection, store: PostgresStore,
                                              outbox: PostgresOutbox) -> None:
    staged = await stage(conn, ["a", "b", "a", "c", "b", "a", "c", "d"])
    inner = open_publisher(kind.url)
    try:
        relay = Relay(outbox, HalfAccepted(inner), RelayConfig(batch_size=8, retry_base=10))
        assert await first_claim(relay) == 4
        rows = await outbox.unpublished()
        assert [r.id for r in rows] == [i for i, _, _ in staged[4:]]
        # Per key: the first unacknowledged event counts an attempt and backs off; the key's later
        # ones are only released. Keys b, a, c, d first fail at positions 4, 5, 6, 7.
        assert [r.attempts for r in rows] == [1, 1, 1, 1]
        assert all(r.next_attempt_at is not None for r in rows)
        assert await Relay(outbox, inner).run_until_idle() == 0, "backing off"
        await store.move_clock(11)
        assert await publish_until(Relay(outbox, inner), 4) == 4
    finally:
        await inner.close()
    seen = await kind.read()
    assert Counter(e for e, _, _ in seen) == Counter(e for _, e, _ in staged), "each exactly once"
    assert_keys_in_order(seen, staged)


async def test_broker_down_events_wait_and_the_relay_recovers(kind: Kind, conn: asyncpg.Connection,
                                                             outbox: PostgresOutbox) -> None:
    proxy: TcpProxy | None = None
    url = kind.url
    if kind.memory is None:
        proxy = TcpProxy(kind.endpoint)
        await proxy.start()
        url = kind.url_for(with_port(kind.base_url, "127.0.0.1", proxy.port))
        await proxy.pause()
    else:
        kind.memory.down = True
    publisher = open_publisher(url)
    relay = Relay(outbox, publisher, RelayConfig(poll_interval=0.05))
    try:
        await relay.start()
        staged = await stage(conn, ["k1", "k2", "k1", None, "k2"])
        await relay.events.wait_until(lambda: relay.events.unavailable >= 2)
        status = await outbox.status()
        assert (status.pending, status.dead) == (5, 0)
        assert [r.attempts for r in await outbox.unpublished()] == [0] * 5, "an unreachable broker counts nothing"
        if proxy is not None:
            await proxy.resume()
        else:
            assert kind.memory is not None
            kind.memory.down = False
        relay.wake()
        await relay.events.wait_until(lambda: relay.events.published >= 5)
    finally:
        await relay.stop()
        await publisher.close()
        if proxy is not None:
            await proxy.close()
    seen = await kind.read()
    assert Counter(e for e, _, _ in seen) == Counter(e for _, e, _ in staged)
    assert_keys_in_order(seen, staged)


async def test_a_refused_event_is_dead_lettered_its_key_waits_and_requeue_resumes_it(
    kind: Kind, conn: asyncpg.Connection, outbox: PostgresOutbox
) -> None:
    await kind.poison("bad")
    first = await stage(conn, ["bad"], type_="poison.pill")
    rest = await stage(conn, ["bad", "good", "bad", "good"])
    publisher = open_publisher(kind.url)
    try:
        relay = Relay(outbox, publisher)
        assert await publish_until(relay, 2) == 2
        dead = await outbox.unpublished(dead=True)
        assert [d.id for d in dead] == [first[0][0]]
        assert dead[0].last_error and dead[0].last_error.startswith("refused")
        waiting = [r for r in await outbox.unpublished() if r.dead_at is None]
        assert [(r.key, r.behind_dead) for r in waiting] == [("bad", True), ("bad", True)]
        assert await relay.run_until_idle() == 0, "the key waits behind its dead event"
        await kind.cure("bad")
        assert await outbox.requeue([first[0][0]]) == [first[0][0]]
        assert await publish_until(relay, 3) == 3
    finally:
        await publisher.close()
    seen = await kind.read()
    staged = first + rest
    assert Counter(e for e, _, _ in seen) == Counter(e for _, e, _ in staged)
    assert_keys_in_order(seen, staged)
    status = await outbox.status()
    assert (status.pending, status.dead) == (0, 0)


async def test_an_older_insert_committing_after_a_newer_one_is_published_first(
    kind: Kind, database_url: str, conn: asyncpg.Connection, outbox: PostgresOutbox
) -> None:
    slow = await asyncpg.connect(database_url)
    publisher = open_publisher(kind.url)
    try:
        relay = Relay(outbox, publisher)
        tx = slow.transaction()
        await tx.start()
        older = await stage(slow, ["k"])  # id allocated first, committed last
        newer = await stage(conn, ["k", None])
        status = await outbox.status()
        assert status.above_horizon == 2, "the open transaction holds back everything staged after it"
        assert await relay.run_until_idle() == 0
        assert await kind.read() == []
        await tx.commit()
        assert await publish_until(relay, 3) == 3
    finally:
        await publisher.close()
        await slow.close()
    seen = await kind.read()
    assert per_key_first(seen)["k"] == [older[0][1], newer[0][1]], "never skipped, never overtaken"
    assert sorted(e for e, _, _ in seen) == sorted(e for _, e, _ in older + newer)
