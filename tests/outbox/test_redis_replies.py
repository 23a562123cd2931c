"""What a Redis reply means for the outbox: a reply about the server's state (full, a read-only replica)
holds the events as an unreachable broker does, an ACL refusal holds them as a misconfiguration; neither
counts an attempt. Against a redis-server of the test's own (never the shared one), skipped without one."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from stepstone.errors import BrokerUnavailable
from stepstone.outbox.publisher import open_publisher
from stepstone.outbox.relay import Relay, RelayConfig
from stepstone.store.outbox import PostgresOutbox
from tests.outbox.conftest import assert_held, held_by_a_refused_setup, own_server, publish_until, stage

redis = pytest.importorskip("redis.asyncio", reason="the redis extra is not installed")


@pytest.fixture
async def own_redis() -> AsyncIterator[str]:
    """The URL of a redis-server of this test's own, with no persistence (never the shared one)."""
    async with own_server("redis-server", "start a Redis of the test's own (the shared one is never filled)",
                          lambda port: ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                        "no", "--maxmemory-policy", "noeviction"]) as port:
        yield f"redis://127.0.0.1:{port}"


async def config(url: str, *command: str) -> None:
    admin = redis.Redis.from_url(url)
    try:
        await admin.execute_command(*command)
    finally:
        await admin.aclose()


@pytest.mark.parametrize("state", ["OOM", "READONLY"])
async def test_a_redis_that_cannot_take_writes_holds_the_events(
    conn: asyncpg.Connection, outbox: PostgresOutbox, own_redis: str, state: str
) -> None:
    """A full Redis (over its maxmemory, noeviction) or one that became a read-only replica refused every
    XADD with a reply about the server, not the event; redis-py strips the reply's code, so the transient
    check ("OOM", "READONLY") never matched and each event was refused: dead-lettered at the first batch."""
    if state == "OOM":
        await config(own_redis, "CONFIG", "SET", "maxmemory", "1")  # a byte: full, every write refused
    else:
        await config(own_redis, "REPLICAOF", "127.0.0.1", "1")  # a primary that is not there: read-only
    staged = await stage(conn, ["k", "k", None])
    publisher = open_publisher(f"{own_redis}?stream=s")
    relay = Relay(outbox, publisher, RelayConfig(max_attempts=1, retry_base=0))
    try:
        for _ in range(2):
            raised = await held_by_a_refused_setup(relay)
            assert isinstance(raised, BrokerUnavailable) and state in str(raised), raised
        rows = await outbox.unpublished()
        assert [(r.attempts, r.state) for r in rows] == [(0, "pending")] * 3
        assert state in (rows[0].last_error or "")
        if state == "OOM":
            await config(own_redis, "CONFIG", "SET", "maxmemory", "0")
        else:
            await config(own_redis, "REPLICAOF", "NO", "ONE")
        assert await publish_until(relay, 3) == 3
        entries = await publisher.read("s")  # type: ignore[attr-defined]
    finally:
        await publisher.close()
    assert [body["id"] for _, body in entries if body["key"] == "k"] == [e for _, e, k in staged if k == "k"]


@pytest.mark.parametrize("denied", ["xadd", "ping"])
async def test_a_redis_acl_refusal_holds_the_events(
    conn: asyncpg.Connection, outbox: PostgresOutbox, own_redis: str, denied: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A user the ACL does not allow to XADD had each event refused (dead-lettered at the first batch); one not
    allowed to PING failed every publish with an error counted against each event. Either is the broker URL's
    user, not the events: held as a misconfiguration."""
    await config(own_redis, "ACL", "SETUSER", "relay", "on", ">pw", "~*", "+@all", f"-{denied}")
    user_url = own_redis.replace("redis://", "redis://relay:pw@")
    await assert_held(conn, outbox, open_publisher(f"{user_url}?stream=s"), "NOPERM", caplog)


@pytest.mark.parametrize("credentials", ["relay:wrong@", ""])
async def test_redis_refusing_the_credentials_holds_the_events(
    conn: asyncpg.Connection, outbox: PostgresOutbox, own_redis: str, credentials: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A wrong password (WRONGPASS) or none where Redis wants one (NOAUTH) was held as an unreachable Redis, said
    in a WARNING line as if the server were down. The credentials are the broker URL's: held as a
    misconfiguration (an ERROR line), as NATS refusing them and a webhook's 401 are."""
    await config(own_redis, "ACL", "SETUSER", "relay", "on", ">pw", "~*", "+@all")
    await config(own_redis, "ACL", "SETUSER", "default", "on", ">pw")  # the default user wants a password too
    url = own_redis.replace("redis://", f"redis://{credentials}")
    await assert_held(conn, outbox, open_publisher(f"{url}?stream=s"), "credentials", caplog)
