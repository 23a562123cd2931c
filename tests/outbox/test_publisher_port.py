"""The publisher port: brokers come in through entry points, and only their adapter imports a client."""

from __future__ import annotations

import ast
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from stepstone.errors import ConfigError, UnknownBroker
from stepstone.outbox.publisher import ENTRY_POINT_GROUP, InMemoryPublisher, PublishResult, Routing, open_publisher
from stepstone.store.outbox import StagedEvent

SRC = Path(__file__).resolve().parents[2] / "src" / "stepstone"
CLIENTS = ("redis", "nats", "aio_pika", "aiormq", "httpx")
ADAPTERS = {"outbox/redis_streams.py", "outbox/nats_jetstream.py", "outbox/rabbitmq.py", "outbox/webhook.py"}


def top_level_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_only_the_adapters_import_a_broker_client() -> None:
    offenders = [
        f"{path.relative_to(SRC)} imports {name}"
        for path in sorted(SRC.rglob("*.py")) if str(path.relative_to(SRC)) not in ADAPTERS
        for name in top_level_imports(path) if name.split(".")[0] in CLIENTS
    ]
    assert offenders == []


def test_every_scheme_is_an_entry_point() -> None:
    names = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert names >= {"memory", "redis", "rediss", "nats", "amqp", "amqps", "http", "https"}


def test_unknown_scheme_and_routing_errors() -> None:
    with pytest.raises(UnknownBroker, match="no publisher for broker URL 'kafka://h:1'"):
        open_publisher("kafka://h:1")
    with pytest.raises(ConfigError, match="unknown field"):
        Routing("stepstone.{topic}")
    assert isinstance(open_publisher("memory://x?target=t.{category}"), InMemoryPublisher)


@pytest.mark.parametrize(("url", "reason"), [
    ("redis://:6379", "it names no host"), ("redis://h:99999", "Port out of range"), ("nats://h:abc", "Port could not"),
    ("amqp://", "it names no host"), ("https://[", "Invalid IPv6 URL"), ("redis://h?maxlen=abc", "maxlen must be a"),
])
def test_a_malformed_broker_url_is_a_config_error(url: str, reason: str) -> None:
    """Each was a client's ValueError (a traceback from `stepstone worker --broker`), or, with no host, an
    error only when the relay first published."""
    with pytest.raises(ConfigError, match=f"is malformed: {reason}"):
        open_publisher(url)


def test_routing_fields() -> None:
    from datetime import UTC, datetime  # noqa: PLC0415

    event = StagedEvent(1, "e", "i", "order.shipped", "o-1", {}, datetime.now(UTC))
    assert Routing("s:{category}:{type}:{key}").target(event) == "s:order:order.shipped:o-1"


async def to_webhook(template: str, keys: list[str]) -> tuple[list[PublishResult], Any]:
    """One event of type `order.shipped` per key, posted through `template` to a local receiver: the
    publisher's results and the receiver (its `paths` and `received`)."""
    from datetime import UTC, datetime  # noqa: PLC0415

    from tests.outbox.brokers import _webhook  # noqa: PLC0415

    kind = _webhook("keys")
    try:
        publisher = open_publisher(kind.base_url + template)
        now = datetime.now(UTC)
        batch = [StagedEvent(n, f"e{n}", "i", "order.shipped", key, {}, now) for n, key in enumerate(keys)]
        try:
            return await publisher.publish(batch), kind.extra["server"]
        finally:
            await publisher.close()
    finally:
        await kind.cleanup()


async def test_a_webhook_url_takes_each_field_as_one_percent_encoded_segment() -> None:
    """A key went into the URL as it was: `../../admin` posted to /admin, `k#f` to /hooks/k, `k?q=1` added a
    query; the receiver could not tell the event's key, and a key could aim the event at another endpoint."""
    results, server = await to_webhook("/hooks/{type}/{key}", ["../../admin", "k#f", "k?q=1", "a b", "p%41"])
    assert all(r.outcome.value == "ok" for r in results)
    assert sorted(server.paths) == sorted([
        "/hooks/order.shipped/..%2F..%2Fadmin", "/hooks/order.shipped/k%23f", "/hooks/order.shipped/k%3Fq%3D1",
        "/hooks/order.shipped/a%20b", "/hooks/order.shipped/p%2541"])


async def test_a_webhook_delivers_an_event_whose_key_no_header_can_carry() -> None:
    """A key a header cannot carry as it is (non-ASCII such as `café`, a line break, spaces around it) made
    the HTTP client refuse every POST of its event (UnicodeEncodeError, LocalProtocolError), each counted as
    a transient failure, so the event could never be delivered: it held its key until it was dead-lettered,
    and a requeue failed the same way. The envelope in the body carries the key; the header is left out."""
    keys = ["café", "a\r\nb", " sp ", "plain", "inner space"]
    results, server = await to_webhook("/hooks/{key}", keys)
    assert [r.outcome.value for r in results] == ["ok"] * len(keys), [r.error for r in results]
    header = {body["key"]: key for _, key, body, _ in server.received}
    assert header == {"café": None, "a\r\nb": None, " sp ": None, "plain": "plain", "inner space": "inner space"}


def test_broker_url_from_flag_env_or_pyproject(tmp_path: Path) -> None:
    from stepstone.config import load_settings  # noqa: PLC0415

    (tmp_path / "pyproject.toml").write_text('[tool.stepstone]\nbroker_url = "nats://from-pyproject:4222"\n')
    assert load_settings(environ={}, cwd=tmp_path).broker_url == "nats://from-pyproject:4222"
    env = load_settings(environ={"STEPSTONE_BROKER_URL": "redis://from-env"}, cwd=tmp_path)
    assert (env.broker_url, env.sources["broker_url"]) == ("redis://from-env", "env STEPSTONE_BROKER_URL")
    flag = load_settings(broker_url="memory://flag", environ={"STEPSTONE_BROKER_URL": "redis://x"}, cwd=tmp_path)
    assert (flag.broker_url, flag.sources["broker_url"]) == ("memory://flag", "--broker-url")


@pytest.mark.parametrize(("url", "reason"), [
    ("redis://h?maxlen=-5", "maxlen must be a whole number from 0"),
    ("redis://h?concurrency=0", "concurrency must be a whole number from 1"),
    ("redis://h?concurrency=abc", "concurrency must be a whole number from 1"),
    ("redis://h?stream=", "stream must not be empty"),
    ("redis://h?bogus=1", "unknown option 'bogus'"),
    ("nats://h?concurrency=0", "concurrency must be a whole number from 1"),
    ("nats://h?subject=", "subject must not be empty"),
    ("nats://h?stream=a.b", "stream 'a.b' is no JetStream stream name"),
    ("nats://h?bogus=1", "unknown option 'bogus'"),
    ("amqp://h?exchange=", "exchange must not be empty"),
    ("amqp://h?concurrency=-3", "concurrency must be a whole number from 1"),
    ("amqp://h?bogus=1", "unknown option 'bogus'"),
    ("memory://x?bogus=1", "unknown option 'bogus'"),
    ("http://h/x#timeout=0", "timeout must be a number of seconds above 0"),
    ("http://h/x#timeout=nan", "timeout must be a number of seconds above 0"),
    ("https://h/x#timeout=", "timeout must not be empty"),
    ("http://h/x#concurrency=0", "concurrency must be a whole number from 1"),
    ("http://h/x?receivers=own#bogus=1", "unknown option 'bogus' in the fragment"),
])
def test_a_bad_broker_option_is_refused_when_the_publisher_is_opened(url: str, reason: str) -> None:
    """`maxlen=-5` was accepted and every XADD then failed with a DataError the relay looped on;
    `concurrency=0` made every publish wait until half the lease; unknown options were ignored."""
    with pytest.raises(ConfigError, match=f"is malformed: {reason}"):
        open_publisher(url)


async def test_good_broker_options_and_the_clients_own_are_accepted() -> None:
    for url in ("redis://h/0?stream=s:{type}&maxlen=0&concurrency=1", "nats://h?subject=a.{type}&stream=S_1",
                "amqp://h/?exchange=x&routing_key={key}&concurrency=8&heartbeat=30&name=relay"):
        publisher = open_publisher(url)
        await publisher.close()


async def test_a_webhook_timeout_names_the_events_url_and_what_timed_out() -> None:
    """A receiver that never answered left `http://.../{type}: ReadTimeout:` (the template, nothing after)."""
    import asyncio  # noqa: PLC0415
    from datetime import UTC, datetime  # noqa: PLC0415

    from stepstone.outbox.webhook import WebhookPublisher  # noqa: PLC0415

    held: list[asyncio.StreamWriter] = []
    answered = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # read the request, never answer
        await reader.readuntil(b"\r\n\r\n")
        await answered.wait()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    publisher = WebhookPublisher(f"http://127.0.0.1:{port}/hooks/{{type}}", timeout=0.2)
    try:
        event = StagedEvent(1, "e1", "i", "order.shipped", "o-1", {}, datetime.now(UTC))
        [result] = await publisher.publish([event])
    finally:
        answered.set()
        await publisher.close()
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
    assert result.outcome.value == "transient" and result.attempted
    assert result.error == f"http://127.0.0.1:{port}/hooks/order.shipped: ReadTimeout: no answer within 0.2 s"


async def test_a_webhook_takes_its_timeout_and_concurrency_from_the_urls_fragment() -> None:
    """The timeout was fixed at 10 s and concurrency at 32, with no way to set either from the broker URL
    (its query is the receiver's). The fragment, which no HTTP client sends, carries them."""
    from stepstone.outbox.webhook import WebhookPublisher  # noqa: PLC0415

    publisher = open_publisher("https://h.example/events/{type}?to=me#timeout=2.5&concurrency=8")
    try:
        assert isinstance(publisher, WebhookPublisher)
        assert (publisher.timeout, publisher.concurrency) == (2.5, 8)
        assert publisher.routing.template == "https://h.example/events/{type}?to=me"  # the fragment stays here
    finally:
        await publisher.close()
    default = open_publisher("https://h.example/events")
    assert (default.timeout, default.concurrency) == (10.0, 32)  # type: ignore[attr-defined]
    await default.close()


async def test_a_webhook_refused_by_status_names_the_events_url() -> None:
    """A status answer said only `HTTP 404 Not Found`: with events routed to several URLs, which one?"""
    import asyncio  # noqa: PLC0415
    from datetime import UTC, datetime  # noqa: PLC0415

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(line.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
        code = b"404 Not Found" if b"/missing" in line.split(b"\r\n")[0] else b"503 Service Unavailable"
        writer.write(b"HTTP/1.1 " + code + b"\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    publisher = open_publisher(f"http://127.0.0.1:{port}/hooks/{{key}}#timeout=5")
    try:
        now = datetime.now(UTC)
        refused, busy = await publisher.publish([StagedEvent(1, "e1", "i", "order.shipped", "missing", {}, now),
                                                 StagedEvent(2, "e2", "i", "order.shipped", "busy", {}, now)])
    finally:
        await publisher.close()
        server.close()
        await server.wait_closed()
    assert (refused.outcome.value, refused.error) == (
        "refused", f"http://127.0.0.1:{port}/hooks/missing: HTTP 404 Not Found")
    assert (busy.outcome.value, busy.error) == (
        "transient", f"http://127.0.0.1:{port}/hooks/busy: HTTP 503 Service Unavailable")
