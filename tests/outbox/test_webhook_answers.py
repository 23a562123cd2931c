"""What a webhook receiver's answer means for the outbox: an answer about the event refuses it; an answer
that can only mean the configured endpoint is wrong for every event holds the outbox, no attempt counted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import asyncpg
import pytest

from stepstone.errors import BrokerMisconfigured
from stepstone.outbox.publisher import open_publisher
from stepstone.outbox.relay import Relay, RelayConfig
from stepstone.store.outbox import PostgresOutbox
from tests.outbox.conftest import assert_held, first_claim, held_by_a_refused_setup, publish_until, stage

REASONS = {200: "OK", 301: "Moved Permanently", 308: "Permanent Redirect", 400: "Bad Request", 401: "Unauthorized",
           403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed", 407: "Proxy Authentication Required",
           410: "Gone", 413: "Content Too Large", 422: "Unprocessable Content"}


@dataclass
class Receiver:
    """A local HTTP receiver answering `status` (per path in `by_path`, else `default`); it records the path and
    the Idempotency-Key of each request it acknowledged, and counts every request per path."""

    url: str = ""
    default: int = 200
    by_path: dict[str, int] = field(default_factory=dict)
    acknowledged: list[tuple[str, str]] = field(default_factory=list)
    asked: dict[str, int] = field(default_factory=dict)

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                lines = head.split("\r\n")
                path = lines[0].split(" ")[1]
                headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
                await reader.readexactly(int(headers["content-length"]))
                status = self.by_path.get(path, self.default)
                self.asked[path] = self.asked.get(path, 0) + 1
                if status == 200:
                    self.acknowledged.append((path, headers["idempotency-key"]))
                extra = "location: https://elsewhere.example/hooks\r\n" if 300 <= status < 400 else ""
                writer.write(f"HTTP/1.1 {status} {REASONS[status]}\r\ncontent-length: 0\r\n{extra}\r\n".encode())
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    found = Receiver()
    server = await asyncio.start_server(found.answer, "127.0.0.1", 0)
    found.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield found
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(("status", "path", "says"), [
    (301, "/hooks", "to https://elsewhere.example/hooks"), (308, "/hooks/{type}", "follows no redirect"),
    (401, "/hooks/{key}", "whatever the event"), (403, "/hooks", "whatever the event"),
    (407, "/hooks", "whatever the event"), (404, "/hooks", "the same for every event"),
    (405, "/hooks", "the same for every event"), (410, "/hooks", "the same for every event"),
])
async def test_an_answer_about_the_endpoint_holds_the_events(
    conn: asyncpg.Connection, outbox: PostgresOutbox, caplog: pytest.LogCaptureFixture, receiver: Receiver,
    status: int, path: str, says: str,
) -> None:
    """A misconfigured webhook URL (a redirect, a wrong token, a fixed URL with no such endpoint) was answered
    the same for every event, and each was refused as if it were the event's fault: the whole outbox was
    dead-lettered at the first batch."""
    receiver.default = status
    await assert_held(conn, outbox, open_publisher(f"{receiver.url}{path}"), f"HTTP {status} {REASONS[status]}",
                      caplog)
    rows = await outbox.unpublished()
    assert all(says in (r.last_error or "") for r in rows), [r.last_error for r in rows]


@pytest.mark.parametrize(("status", "path"), [(400, "/hooks"), (413, "/hooks"), (422, "/hooks"),
                                              (404, "/hooks/{key}"), (405, "/hooks/{type}")])
async def test_an_answer_about_one_event_refuses_it(
    conn: asyncpg.Connection, outbox: PostgresOutbox, receiver: Receiver, status: int, path: str
) -> None:
    receiver.default = status
    await stage(conn, ["k"])
    publisher = open_publisher(f"{receiver.url}{path}")
    try:
        await first_claim(Relay(outbox, publisher, RelayConfig(max_attempts=5)))
    finally:
        await publisher.close()
    [dead] = await outbox.unpublished(dead=True)
    assert f"HTTP {status} {REASONS[status]}" in (dead.last_error or "")


async def test_a_batch_that_meets_a_held_endpoint_keeps_what_was_acknowledged(
    conn: asyncpg.Connection, outbox: PostgresOutbox, receiver: Receiver
) -> None:
    """Events to a path the receiver refuses whatever the event are held (that path asked once a batch), the
    events acknowledged beside them are published, and once the receiver accepts, the held ones go out in
    each key's order."""
    receiver.by_path["/hooks/no"] = 403
    ok = await stage(conn, ["a", "b"], type_="ok.made")
    no = await stage(conn, ["c", "c", "d"], type_="no.made")
    publisher = open_publisher(f"{receiver.url}/hooks/{{category}}#concurrency=1")
    relay = Relay(outbox, publisher, RelayConfig(max_attempts=1, retry_base=0))
    try:
        assert isinstance(await held_by_a_refused_setup(relay), BrokerMisconfigured)
        assert receiver.acknowledged == [("/hooks/ok", eid) for _, eid, _ in ok]
        assert receiver.asked["/hooks/no"] == 1, "the held endpoint is asked once a batch, not once an event"
        rows = await outbox.unpublished()
        assert [(r.id, r.attempts, r.state) for r in rows] == [(i, 0, "pending") for i, _, _ in no]
        assert all("HTTP 403 Forbidden" in (rows[n].last_error or "") for n in (0, 2)), "c's first event, and d's"
        del receiver.by_path["/hooks/no"]
        assert await publish_until(relay, 3) == 3
    finally:
        await publisher.close()
    arrived = [eid for path, eid in receiver.acknowledged if path == "/hooks/no"]
    assert sorted(arrived) == sorted(eid for _, eid, _ in no)
    assert arrived.index(no[0][1]) < arrived.index(no[1][1]), "key c in staged order"
