"""Fixtures of the outbox tests: the store, staging events, and one broker kind per parameter."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import asyncpg
import pytest

from stepstone.outbox.relay import Relay, RelayConfig
from stepstone.store.outbox import PostgresOutbox
from stepstone.store.postgres import PostgresStore
from tests._pg import PgServer
from tests.outbox.brokers import KINDS, Kind, open_kind

STAGE = """
INSERT INTO stepstone.outbox (event_id, instance_id, type, key, payload, created_at, trace_context)
SELECT gen_random_uuid(), $1, x.type, x.key, jsonb_build_object('n', x.n), now(), $4
FROM unnest($2::text[], $3::text[]) WITH ORDINALITY AS x(type, key, n)
ORDER BY x.n
RETURNING id, event_id::text, key
"""


async def stage(
    conn: asyncpg.Connection, keys: Sequence[str | None], *, type_: str = "ev.made", instance: uuid.UUID | None = None,
    trace: str | None = None,
) -> list[tuple[int, str, str | None]]:
    """Stage one event per key (in that order) as a step commit would; returns (id, event id, key)."""
    context = json.dumps({"traceparent": trace}) if trace else None
    rows = await conn.fetch(STAGE, instance or uuid.uuid4(), [type_] * len(keys), list(keys), context)
    return [(r["id"], r["event_id"], r["key"]) for r in rows]


HORIZON_WAIT = 30.0
T = TypeVar("T")


async def past_the_horizon(attempt: Callable[[], Awaitable[T]], took: Callable[[T], bool]) -> T:
    """`attempt()` until `took` its result; that result, or the last one once HORIZON_WAIT has passed (the
    caller's assertions say what was missing).

    A transaction open anywhere on the server (another database too: transaction ids are per server)
    holds the visibility horizon back while it runs, so on a shared server a claim can come back empty
    for a moment. PostgreSQL tells no one when such a foreign transaction ends: this looks again every
    10 ms, and never waits for the test's own work, which `attempt` does."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HORIZON_WAIT
    while True:
        result = await attempt()
        if took(result) or loop.time() >= deadline:
            return result
        await asyncio.sleep(0.01)


async def publish_until(relay: Relay, expected: int) -> int:
    """`run_until_idle` until `expected` events are published (see `past_the_horizon`); the count published."""
    total = 0

    async def more() -> int:
        nonlocal total
        total += await relay.run_until_idle()
        return total

    return await past_the_horizon(more, lambda n: n >= expected)


async def first_claim(relay: Relay) -> int:
    """`run_once` until a claim takes something (see `past_the_horizon`); returns the count published."""
    return await past_the_horizon(relay.run_once, lambda _: bool(relay.last_claimed))


async def claim(outbox: PostgresOutbox, limit: int = 500, relay: str = "r", *, some: bool = True
                ) -> tuple[uuid.UUID, list[int]]:
    """One claim; when `some`, repeated while it comes back empty (see `past_the_horizon`)."""
    async def once() -> tuple[uuid.UUID, list[int]]:
        token = uuid.uuid4()
        return token, [e.id for e in await outbox.claim(limit, 30, relay, token)]

    return await past_the_horizon(once, lambda got: bool(got[1]) or not some)


async def held_by_a_refused_setup(relay: Relay) -> Exception:
    """`run_once` until its claim takes something (a transaction elsewhere may hold the horizon) and the
    publish fails; the error it raised."""
    async def once() -> Exception | None:
        try:
            await relay.run_once()
        except Exception as exc:  # noqa: BLE001 - the test looks at what it is
            return exc
        return None

    raised = await past_the_horizon(once, lambda exc: exc is not None)
    if raised is None:
        raise AssertionError("no claim took the staged events")
    return raised


async def assert_held(conn: asyncpg.Connection, outbox: PostgresOutbox, publisher: Any, says: str,
                      caplog: pytest.LogCaptureFixture) -> None:
    """Two events meet a broker that refuses the publisher's setup, with max_attempts=1: held, not dead."""
    from stepstone.errors import BrokerMisconfigured  # noqa: PLC0415

    await stage(conn, ["k", None])
    relay = Relay(outbox, publisher, RelayConfig(max_attempts=1, retry_base=0))
    try:
        for _ in range(2):
            assert isinstance(await held_by_a_refused_setup(relay), BrokerMisconfigured)
        rows = await outbox.unpublished()
        assert [(r.attempts, r.state, r.claimed_by) for r in rows] == [(0, "pending", None)] * 2
        assert all(says in (r.last_error or "") for r in rows)
        assert await outbox.unpublished(dead=True) == []
        assert relay.events.misconfigured == 2
        with caplog.at_level(logging.WARNING, "stepstone.relay"):  # the loop says it once, as an error
            await relay.start()
            await relay.events.wait_until(lambda: relay.events.misconfigured >= 3, timeout=30)
            await relay.stop()
        lines = [r for r in caplog.records if r.name == "stepstone.relay"]
        assert [r.levelname for r in lines] == ["ERROR"]
        assert "refuses the publisher's setup" in lines[0].getMessage() and says in lines[0].getMessage()
        assert "no attempt counted" in lines[0].getMessage() and not lines[0].exc_info
    finally:
        await publisher.close()


@contextlib.asynccontextmanager
async def own_server(binary: str, why: str, arguments: Callable[[int], list[str]]) -> AsyncIterator[int]:
    """A broker process of the test's own (`binary` run with `arguments(port)`) on a free local port, once it
    accepts connections; its port. Skips, saying it needs `binary` to `why`, when there is none."""
    found = shutil.which(binary, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/usr/local/bin")
    if found is None:
        pytest.skip(f"no {binary} binary to {why}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = await asyncio.create_subprocess_exec(found, *arguments(port), stdout=asyncio.subprocess.DEVNULL,
                                                  stderr=asyncio.subprocess.DEVNULL)
    try:
        async def accepting() -> bool:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                return False
            writer.close()
            return True

        assert await past_the_horizon(accepting, bool), f"{binary} never accepted a connection"
        yield port
    finally:
        server.terminate()
        await server.wait()


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[PostgresStore]:
    s = await PostgresStore.open(database_url, max_size=8)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
def outbox(store: PostgresStore) -> PostgresOutbox:
    return PostgresOutbox(store)


@pytest.fixture(params=KINDS)
async def kind(request: pytest.FixtureRequest) -> AsyncIterator[Kind]:
    k = await open_kind(request.param)
    try:
        yield k
    finally:
        await k.cleanup()


@pytest.fixture(autouse=True)
def _no_background_transaction(pg_server: PgServer, database_url: str) -> None:
    """The harness creates the next test database in the background; that transaction holds back the
    visibility horizon while it runs, so outbox tests start once it has finished."""
    if pg_server._next_clone is not None:
        pg_server._next_clone.result()
