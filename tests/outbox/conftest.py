"""Fixtures of the outbox tests: the store, staging events, and one broker kind per parameter."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import asyncpg
import pytest

from stepstone.outbox.relay import Relay
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
