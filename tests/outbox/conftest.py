"""Fixtures of the outbox tests: the store, staging events, and one broker kind per parameter."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Sequence

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


async def publish_until(relay: Relay, expected: int) -> int:
    """`run_until_idle` until `expected` events are published; returns the count published.

    A transaction open anywhere on the server (another database too: transaction ids are per server)
    holds the visibility horizon back while it runs, so on a shared server a claim can come back empty
    for a moment. This waits for such a foreign transaction to end, never for the test's own work."""
    deadline = asyncio.get_running_loop().time() + HORIZON_WAIT
    total = await relay.run_until_idle()
    while total < expected and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
        total += await relay.run_until_idle()
    return total


async def first_claim(relay: Relay) -> int:
    """`run_once` until a claim takes something (see `publish_until`); returns the count published."""
    deadline = asyncio.get_running_loop().time() + HORIZON_WAIT
    published = await relay.run_once()
    while not relay.last_claimed and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
        published = await relay.run_once()
    return published


async def claim(outbox: PostgresOutbox, limit: int = 500, relay: str = "r", *, some: bool = True
                ) -> tuple[uuid.UUID, list[int]]:
    """One claim; when `some`, repeated while it comes back empty because a transaction elsewhere on
    the server holds the visibility horizon (see tests/outbox/conftest.py `publish_until`)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HORIZON_WAIT
    while True:
        token = uuid.uuid4()
        ids = [e.id for e in await outbox.claim(limit, 30, relay, token)]
        if ids or not some or loop.time() > deadline:
            return token, ids
        await asyncio.sleep(0.01)


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
