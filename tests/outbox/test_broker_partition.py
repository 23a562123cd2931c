"""A broker that stops answering on the relay's open connection (a partition, a hung node): the events
wait with no attempt counted, as when the broker cannot be reached at all, and go out once it answers."""

from __future__ import annotations

from collections import Counter

import asyncpg
import pytest

from stepstone.errors import BrokerUnavailable
from stepstone.outbox.publisher import open_publisher
from stepstone.outbox.relay import Relay, RelayConfig
from stepstone.store.outbox import PostgresOutbox
from tests.chaos.rig.proxy import Proxy
from tests.outbox.brokers import Kind, with_port
from tests.outbox.conftest import first_claim, publish_until, stage
from tests.outbox.test_conformance import assert_keys_in_order


async def test_a_broker_that_stops_answering_mid_connection_counts_no_attempt(
    kind: Kind, conn: asyncpg.Connection, outbox: PostgresOutbox
) -> None:
    """Through a connection that forwarded nothing any more, a Redis PING (redis-py retrying it) outlived
    half the lease and every event of the batch counted a failed attempt; NATS and RabbitMQ counted one
    for each key's first event when its acknowledgement timed out, batch after batch. A partition of a
    few minutes dead-lettered events a broker that was down never does."""
    if kind.memory is not None or kind.name == "webhook":
        pytest.skip("a broker client's own connection is what is cut")
    proxy = Proxy(*kind.endpoint)
    await proxy.start()
    publisher = open_publisher(kind.url_for(with_port(kind.base_url, "127.0.0.1", proxy.port)))
    relay = Relay(outbox, publisher, RelayConfig(lease_seconds=20.0, retry_base=0))
    try:
        before = await stage(conn, ["k"])
        assert await publish_until(relay, 1) == 1, "connected and publishing"
        proxy.cut()
        staged = await stage(conn, ["k", "j", "k", None])
        with pytest.raises(BrokerUnavailable):
            await first_claim(relay)
        rows = await outbox.unpublished()
        assert [(r.attempts, r.dead_at) for r in rows] == [(0, None)] * 4, \
            f"a broker that stopped answering counts no attempt: {[r.last_error for r in rows]}"
        proxy.heal()
        assert await publish_until(relay, 4) == 4
    finally:
        await publisher.close()
        await proxy.close()
    seen = await kind.read()
    everything = before + staged
    assert set(Counter(e for e, _, _ in seen)) == {e for _, e, _ in everything}
    assert_keys_in_order(seen, everything)
