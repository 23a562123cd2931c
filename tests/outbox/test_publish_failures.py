"""A publish that fails with an error of the event or of the configuration (no broker answer at all):
the batch is settled, its attempts counted and the error kept, never left leased to loop for ever."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest

from stepstone.outbox.publisher import PublishResult, open_publisher, publish_in_lanes
from stepstone.outbox.relay import Relay, RelayConfig
from stepstone.store.outbox import PostgresOutbox, StagedEvent
from tests.outbox.brokers import Kind
from tests.outbox.conftest import assert_held, first_claim, held_by_a_refused_setup, own_server, stage


class Exploding:
    """A publisher whose every publish fails with an error no publisher result names."""

    name = "exploding://"

    async def publish(self, batch: Sequence[StagedEvent]) -> list[PublishResult]:
        raise RuntimeError(f"bad option for {len(batch)} event(s)")

    async def close(self) -> None:
        return None


class ExplodingSend(Exploding):
    """The same failure inside one event's send, which `publish_in_lanes` runs beside the others."""

    async def publish(self, batch: Sequence[StagedEvent]) -> list[PublishResult]:
        async def send(event: StagedEvent) -> PublishResult:
            if event.key == "bad":
                raise ValueError("this event cannot be sent")
            return PublishResult.OK

        return await publish_in_lanes(batch, send)


async def test_a_publish_that_raises_counts_an_attempt_and_settles_the_batch(
    conn: asyncpg.Connection, outbox: PostgresOutbox, caplog: pytest.LogCaptureFixture
) -> None:
    await stage(conn, ["k", "k", None])
    relay = Relay(outbox, Exploding(), RelayConfig(max_attempts=2, retry_base=0))
    with caplog.at_level(logging.WARNING, "stepstone.relay"):
        assert await first_claim(relay) == 0
    rows = await outbox.unpublished()
    assert [(r.attempts, r.claimed_by) for r in rows] == [(1, None), (0, None), (1, None)], \
        "settled (not left leased), the key's first event and the unkeyed one counted"
    assert all("RuntimeError: bad option for 3 event(s)" in (r.last_error or "") for r in (rows[0], rows[2]))
    assert "RuntimeError: bad option" in caplog.text
    await first_claim(relay)
    assert [r.id for r in await outbox.unpublished(dead=True)] == [rows[0].id, rows[2].id], \
        "after max_attempts they are dead letters, not retried for ever"


async def test_a_send_that_raises_fails_its_event_only(conn: asyncpg.Connection, outbox: PostgresOutbox) -> None:
    await stage(conn, ["bad", "good", "bad"])
    relay = Relay(outbox, ExplodingSend(), RelayConfig(retry_base=10))
    assert await first_claim(relay) == 1
    rows = await outbox.unpublished()
    assert [(r.key, r.attempts) for r in rows] == [("bad", 1), ("bad", 0)]
    assert rows[0].last_error == "ValueError: this event cannot be sent"


async def test_a_redis_client_error_refuses_the_event(conn: asyncpg.Connection, outbox: PostgresOutbox) -> None:
    """redis-py checks some arguments itself (a DataError, no ResponseError): that escaped `publish`."""
    url = os.environ.get("STEPSTONE_TEST_REDIS_URL")
    if not url:
        pytest.skip("STEPSTONE_TEST_REDIS_URL is not set")
    from stepstone.outbox.redis_streams import RedisStreamsPublisher  # noqa: PLC0415 - needs the extra

    await stage(conn, ["k"])
    publisher = RedisStreamsPublisher(url, maxlen=-5)  # past the URL's checks, as a direct caller may
    try:
        await first_claim(Relay(outbox, publisher))
    finally:
        await publisher.close()
    dead = await outbox.unpublished(dead=True)
    assert len(dead) == 1
    assert dead[0].last_error is not None
    assert "maxlen" in dead[0].last_error


def record_connections(monkeypatch: pytest.MonkeyPatch, client: Any) -> list[Any]:
    """Every connection `client.connect` opens from now on (the real one, kept to look at afterwards)."""
    opened: list[Any] = []
    connect = client.connect

    async def recording(*args: Any, **kwargs: Any) -> Any:
        opened.append(await connect(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(client, "connect", recording)
    return opened


async def fails_three_times_closing_each(publisher: Any, match: str, opened: list[Any]) -> None:
    """Three publishes of one event fail with `match`; each connection they opened is closed."""
    event = StagedEvent(1, str(uuid.uuid4()), str(uuid.uuid4()), "ev.made", "k", {}, datetime.now(UTC))
    try:
        for _ in range(3):
            with pytest.raises(Exception, match=match):
                await publisher.publish([event])
        assert len(opened) == 3
        assert all(connection.is_closed for connection in opened)
    finally:
        await publisher.close()


async def test_a_nats_stream_jetstream_will_not_create_leaves_no_connection_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream whose subjects overlap another stream's fails every batch; each batch's attempt opened a
    NATS connection and left it open (three failed batches: three connections held by the relay)."""
    from stepstone.outbox import nats_jetstream  # noqa: PLC0415 - only with the nats extra
    from stepstone.outbox.publisher import open_publisher  # noqa: PLC0415
    from tests.outbox.brokers import open_kind  # noqa: PLC0415

    kind = await open_kind("nats")
    opened = record_connections(monkeypatch, nats_jetstream)
    publisher = open_publisher(f"{kind.base_url}?subject={kind.tag}.ev.{{type}}&stream=OVERLAP{kind.tag.upper()}")
    try:
        await fails_three_times_closing_each(publisher, "overlap", opened)
    finally:
        await kind.cleanup()


class AcknowledgesThenHangs(Exploding):
    """A broker that acknowledges `budget` events, then answers nothing more (a slow or stuck broker)."""

    name = "hangs://"

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.sent: list[str] = []
        self.stuck = asyncio.Event()  # never set: the publish outlives half the lease

    async def publish(self, batch: Sequence[StagedEvent]) -> list[PublishResult]:
        async def send(event: StagedEvent) -> PublishResult:
            if self.budget <= 0:
                await self.stuck.wait()
            self.budget -= 1
            self.sent.append(event.event_id)
            return PublishResult.OK

        return await publish_in_lanes(batch, send, concurrency=1)


async def test_a_publish_cut_at_half_the_lease_keeps_what_the_broker_acknowledged(
    conn: asyncpg.Connection, outbox: PostgresOutbox
) -> None:
    """A broker slower than half the lease for a whole batch (a webhook at 50 ms a POST and 300 events of
    one key) had every batch cut short and counted as failed: what it had acknowledged was never marked,
    so the relay sent the same prefix again and again and dead-lettered the key's first event, which the
    broker had taken each time."""
    staged = await stage(conn, ["k", "k", "k", "k", "k", "j"])
    ids = [i for i, _, _ in staged]
    broker = AcknowledgesThenHangs(budget=3)
    relay = Relay(outbox, broker, RelayConfig(lease_seconds=1.0, retry_base=60))
    assert await first_claim(relay) == 3
    rows = {r.id: r for r in await outbox.unpublished()}
    assert sorted(rows) == ids[3:], "k's acknowledged prefix is published"
    assert rows[ids[3]].attempts == 1 and "half the lease" in (rows[ids[3]].last_error or ""), \
        "the event the broker never answered counts a failed attempt"
    assert (rows[ids[4]].attempts, rows[ids[5]].attempts) == (0, 0), "never sent: no attempt counted"


async def test_an_exchange_rabbitmq_will_not_declare_leaves_no_connection_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exchange of that name of another type fails every batch (PRECONDITION_FAILED); each batch's
    attempt opened a connection and left it open."""
    url = os.environ.get("STEPSTONE_TEST_AMQP_URL")
    if not url:
        pytest.skip("STEPSTONE_TEST_AMQP_URL is not set")
    import aio_pika  # noqa: PLC0415 - only with the rabbitmq extra

    from stepstone.outbox import rabbitmq  # noqa: PLC0415
    from stepstone.outbox.publisher import open_publisher  # noqa: PLC0415

    name = f"t{uuid.uuid4().hex[:10]}"
    admin = await aio_pika.connect(url)
    channel = await admin.channel()
    await channel.declare_exchange(name, aio_pika.ExchangeType.DIRECT, auto_delete=True)
    opened = record_connections(monkeypatch, rabbitmq.aio_pika)
    publisher = open_publisher(f"{url}?exchange={name}")
    try:
        await fails_three_times_closing_each(publisher, "inequivalent arg 'type'", opened)
    finally:
        await admin.close()


async def test_a_nats_stream_that_overlaps_holds_the_events(
    conn: asyncpg.Connection, outbox: PostgresOutbox, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream whose subjects overlap another's failed every batch as the events' attempt: after
    max_attempts every event of the outbox was dead-lettered, for a mistake of the configuration."""
    from stepstone.outbox.publisher import open_publisher  # noqa: PLC0415
    from tests.outbox.brokers import open_kind  # noqa: PLC0415

    kind = await open_kind("nats")
    try:
        publisher = open_publisher(f"{kind.base_url}?subject={kind.tag}.ev.{{type}}&stream=OVERLAP{kind.tag.upper()}")
        await assert_held(conn, outbox, publisher, "overlap", caplog)
    finally:
        await kind.cleanup()


@pytest.fixture
async def nats_without_jetstream() -> AsyncIterator[str]:
    """The URL of a NATS server of this test's own, started without JetStream (skipped with no nats-server)."""
    async with own_server("nats-server", "start a server without JetStream",
                          lambda port: ["-a", "127.0.0.1", "-p", str(port)]) as port:
        yield f"nats://127.0.0.1:{port}"


@pytest.mark.parametrize("query", ["", "&stream=NOJS"])
async def test_a_nats_server_without_jetstream_holds_the_events(
    conn: asyncpg.Connection, outbox: PostgresOutbox, caplog: pytest.LogCaptureFixture, nats_without_jetstream: str,
    query: str,
) -> None:
    """A server started without JetStream (a configuration's mistake) answered every event "no JetStream
    stream captures subject ...": the whole outbox was refused and dead-lettered at the first batch. With
    `stream=`, its setup failed with JetStream's 503, which every batch counted as the events' attempt."""
    publisher = open_publisher(f"{nats_without_jetstream}?subject=t.{{type}}{query}")
    await assert_held(conn, outbox, publisher, "JetStream", caplog)


async def test_nats_refusing_the_credentials_holds_the_events(
    conn: asyncpg.Connection, outbox: PostgresOutbox, caplog: pytest.LogCaptureFixture
) -> None:
    """A server refusing the broker URL's credentials ("Authorization Violation") failed every publish with
    an error counted against each event: the whole outbox was dead-lettered after max_attempts. The
    credentials are the configuration's, not the events': held as a misconfiguration."""
    async with own_server("nats-server", "start a server that requires a password",
                          lambda port: ["-a", "127.0.0.1", "-p", str(port), "--user", "u", "--pass", "pw"]) as port:
        publisher = open_publisher(f"nats://u:wrong@127.0.0.1:{port}?subject=t.{{type}}")
        await assert_held(conn, outbox, publisher, "Authorization Violation", caplog)


async def test_a_rabbitmq_exchange_of_another_type_holds_the_events(
    conn: asyncpg.Connection, outbox: PostgresOutbox, caplog: pytest.LogCaptureFixture
) -> None:
    """An exchange of that name and another type: every event dead-lettered after max_attempts, before."""
    url = os.environ.get("STEPSTONE_TEST_AMQP_URL")
    if not url:
        pytest.skip("STEPSTONE_TEST_AMQP_URL is not set")
    import aio_pika  # noqa: PLC0415 - only with the rabbitmq extra

    from stepstone.outbox.publisher import open_publisher  # noqa: PLC0415

    name = f"t{uuid.uuid4().hex[:10]}"
    admin = await aio_pika.connect(url)
    try:
        channel = await admin.channel()
        await channel.declare_exchange(name, aio_pika.ExchangeType.DIRECT, auto_delete=True)
        await assert_held(conn, outbox, open_publisher(f"{url}?exchange={name}"), "inequivalent arg 'type'", caplog)
    finally:
        await admin.close()


async def test_rabbitmq_refusing_the_credentials_holds_the_events(
    conn: asyncpg.Connection, outbox: PostgresOutbox, caplog: pytest.LogCaptureFixture
) -> None:
    """A login RabbitMQ refuses (ACCESS_REFUSED) was held as an unreachable broker, said in a WARNING line as
    if it were down. The credentials are the broker URL's: held as a misconfiguration (an ERROR line), as a
    webhook's 401 and Redis or NATS refusing them are."""
    url = os.environ.get("STEPSTONE_TEST_AMQP_URL")
    if not url:
        pytest.skip("STEPSTONE_TEST_AMQP_URL is not set")
    wrong = re.sub(r"//([^:@/]+):[^@/]*@", r"//\1:wrong@", url)
    assert wrong != url, "the test URL carries a password to get wrong"
    await assert_held(conn, outbox, open_publisher(wrong), "credentials", caplog)


def rabbitmqctl(*args: str) -> str | None:
    """rabbitmqctl's output, or None where it cannot reach the broker (not installed, not allowed)."""
    import subprocess  # noqa: PLC0415

    tool = shutil.which("rabbitmqctl")
    if tool is None:
        return None
    done = subprocess.run([tool, *args], capture_output=True, text=True, timeout=60, check=False)
    return done.stdout if done.returncode == 0 else None


class _Said(asyncio.Event):
    """Set once a log record (any logger, any thread) says `text`; `handler` is on the root logger."""

    def __init__(self, text: str) -> None:
        super().__init__()
        loop = asyncio.get_running_loop()
        said = self

        class Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if text in record.getMessage():
                    loop.call_soon_threadsafe(said.set)

        self.handler = Handler()
        logging.getLogger().addHandler(self.handler)


async def test_a_rabbitmq_connection_the_broker_closes_is_said_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An operator's close of the publisher's connection: aiormq logged an ERROR ("Unexpected connection
    close from remote") and a WARNING with a traceback ("Cancelling cause reader exited abnormally"),
    though the next batch simply connects again."""
    url = os.environ.get("STEPSTONE_TEST_AMQP_URL")
    if not url or rabbitmqctl("list_connections", "pid") is None:
        pytest.skip("needs STEPSTONE_TEST_AMQP_URL and rabbitmqctl on the broker's machine")
    from stepstone.outbox.publisher import open_publisher  # noqa: PLC0415

    tag = f"t{uuid.uuid4().hex[:10]}"
    publisher = open_publisher(f"{url}?exchange={tag}&name={tag}")

    def event() -> StagedEvent:
        return StagedEvent(1, str(uuid.uuid4()), str(uuid.uuid4()), "ev.made", "k", {}, datetime.now(UTC))

    closed = _Said("closed by the test")
    try:
        await publisher.publish([event()])  # connected (no queue is bound: refused, which is beside the point)
        listing = rabbitmqctl("list_connections", "pid", "client_properties") or ""
        [pid] = [line.split("\t")[0] for line in listing.splitlines() if tag in line]
        with caplog.at_level(logging.DEBUG):
            assert rabbitmqctl("close_connection", pid, "closed by the test") is not None
            deadline = asyncio.get_running_loop().time() + 30.0
            try:
                await asyncio.wait_for(closed.wait(), 30.0)  # the publisher's own log line about it
            except TimeoutError:
                raise AssertionError("the close was never said") from None
            # The next batches connect again (one may still meet the closing channel: not sent, not counted).
            while not (await publisher.publish([event()]))[0].attempted:
                assert asyncio.get_running_loop().time() < deadline, "never connected again"
    finally:
        logging.getLogger().removeHandler(closed.handler)
        await publisher.close()
    said = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [(r.name, r.levelname, r.exc_info) for r in said] == [("stepstone.outbox.rabbitmq", "WARNING", None)]
    assert "(320 CONNECTION_FORCED - closed by the test); it connects again" in said[0].getMessage()


async def test_a_target_the_client_can_never_send_to_is_refused_at_once(
    kind: Kind, conn: asyncpg.Connection, outbox: PostgresOutbox
) -> None:
    """A routing template with `{key}` can make a target the broker's client will not send: a NATS subject
    with a space (BadSubjectError), a RabbitMQ routing key over 255 bytes (TypeError while encoding). Each
    was counted a transient failure and sent again, its key held, until max_attempts dead-lettered it."""
    routes = {"nats": (f"{kind.tag}.ev.{{key}}", "a b"), "rabbitmq": ("ev.{key}", "k" * 256)}
    if kind.name not in routes:
        pytest.skip("only NATS subjects and RabbitMQ routing keys have a form their client refuses")
    template, bad = routes[kind.name]
    staged = await stage(conn, [bad, "good", bad])
    publisher = open_publisher(kind.url, routing=template)
    try:
        assert await first_claim(Relay(outbox, publisher, RelayConfig(retry_base=60))) == 1
    finally:
        await publisher.close()
    rows = await outbox.unpublished()
    assert [(r.id, r.attempts, r.state) for r in rows] == [(staged[0][0], 1, "dead"), (staged[2][0], 0, "pending")]
    assert (rows[0].last_error or "").startswith("refused"), rows[0].last_error


async def test_a_rabbitmq_event_whose_type_is_over_255_bytes_is_delivered(
    conn: asyncpg.Connection, outbox: PostgresOutbox
) -> None:
    """The message's `type` property is an AMQP short string: an event type of more than 255 bytes (130
    characters `é`, within the 200 characters a type may have) failed every publish in the client
    (TypeError), counted as transient, until the event was dead-lettered. Its type rides in the headers and
    the envelope; the property is left out."""
    from tests.outbox.brokers import open_kind  # noqa: PLC0415

    kind = await open_kind("rabbitmq")
    try:
        [(_, event_id, _)] = await stage(conn, ["k"], type_="é" * 130)
        publisher = open_publisher(kind.url, routing="ev.fixed")
        try:
            assert await first_claim(Relay(outbox, publisher)) == 1, (await outbox.unpublished())[0].last_error
        finally:
            await publisher.close()
        assert [e for e, _, _ in await kind.read()] == [event_id]
    finally:
        await kind.cleanup()


class HeldThenHangs(Exploding):
    """A publisher that answers one key's event with an answer about its configuration (held) while another
    event's send never ends: the publish is cut at half the lease."""

    name = "held-then-hangs://"

    async def publish(self, batch: Sequence[StagedEvent]) -> list[PublishResult]:
        stuck = asyncio.Event()  # never set

        async def send(event: StagedEvent) -> PublishResult:
            if event.key == "held":
                return PublishResult.held("held-then-hangs://: the endpoint is wrong for every event")
            await stuck.wait()
            return PublishResult.OK

        return await publish_in_lanes(batch, send)


async def test_a_held_answer_in_a_publish_cut_at_half_the_lease_still_holds(
    conn: asyncpg.Connection, outbox: PostgresOutbox
) -> None:
    """A held answer (the configuration's mistake) in a publish the relay then cut at half the lease was
    released like any unsent event, and the relay went on at once instead of holding the outbox."""
    from stepstone.errors import BrokerMisconfigured  # noqa: PLC0415

    await stage(conn, ["held", "slow"])
    relay = Relay(outbox, HeldThenHangs(), RelayConfig(lease_seconds=1.0, max_attempts=5, retry_base=0))
    assert isinstance(await held_by_a_refused_setup(relay), BrokerMisconfigured)
    rows = {r.key: r for r in await outbox.unpublished()}
    assert rows["held"].attempts == 0
    assert rows["held"].last_error == "held-then-hangs://: the endpoint is wrong for every event"
    assert rows["slow"].attempts == 1, "the send the cut interrupted counts, as any cut send does"
    assert relay.events.misconfigured == 1
