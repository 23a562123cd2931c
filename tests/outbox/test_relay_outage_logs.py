"""A relay whose database goes away and comes back: its loop warns at the first failed round (and every
20th) and says when it works again; the wake-up connection, which fails at every round of the outage
too, warns at most once instead of at each."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from stepstone.outbox.publisher import open_publisher
from stepstone.outbox.relay import Relay, RelayConfig
from stepstone.store.outbox import PostgresOutbox
from tests.outages import Outage

ROUNDS = 3


class OutboxOutage(Outage):
    """The real outbox, except that while `down` its LISTEN and claim fail."""

    def __init__(self, outbox: PostgresOutbox) -> None:
        super().__init__(outbox, ("listen", "claim"), rounds=ROUNDS)
        self.claimed_again = asyncio.Event()

    async def listen(self, *args: Any, **kwargs: Any) -> Any:
        return await self.listening("listen", self.real.listen, *args, **kwargs)

    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        self.check("claim")
        claimed = await self.real.claim(*args, **kwargs)
        if self.failed["claim"]:
            self.claimed_again.set()
        return claimed


async def test_an_outage_is_told_by_the_relays_loop(outbox: PostgresOutbox, caplog: pytest.LogCaptureFixture) -> None:
    outage = OutboxOutage(outbox)
    publisher = open_publisher("memory://relay-outage")
    relay = Relay(outage, publisher, RelayConfig(poll_interval=0.05))  # type: ignore[arg-type]
    with caplog.at_level(logging.DEBUG, logger="stepstone.relay"):
        await relay.start()
        try:
            await outage.take_down()
            relay.wake()
            await asyncio.wait_for(outage.met.wait(), 30)
            outage.down = False
            relay.wake()
            await asyncio.wait_for(outage.claimed_again.wait(), 30)
        finally:
            await relay.stop()
            await publisher.close()
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "stepstone.relay"]
    warned = [m for level, m in said if level >= logging.WARNING]
    wake_ups = [m for m in warned if m.startswith("relay wake-up connection unavailable")]
    assert len(wake_ups) <= 1, said
    assert len([m for m in warned if "DatabaseUnavailable: cannot reach" in m]) == 1, said  # the loop's first
    assert sum(m.startswith("relay wake-up") for level, m in said if level == logging.DEBUG) >= ROUNDS - 1, said
    assert all(m.endswith("; polling every 0.05 s") for _, m in said if m.startswith("relay wake-up")), said
    assert [m for level, m in said if level == logging.INFO and "working again after" in m], said
