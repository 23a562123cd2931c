"""Any role that can connect may NOTIFY the wake-up channel: a flood of notifications must not become a
flood of claim statements (the claim loop coalesces wake-ups to one claim per ``min_wake_interval``)."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from stepstone.runtime.worker import WorkerConfig
from stepstone.store.port import Claim
from stepstone.testing import Engine

NOTIFIES = 1500


@pytest.mark.parametrize("interval", [WorkerConfig().min_wake_interval, 0.05])
async def test_a_notify_flood_makes_few_claims(engine: Engine, database_url: str, interval: float) -> None:
    worker = engine.new_worker(concurrency=2, poll_interval=60, min_wake_interval=interval)
    claims: list[float] = []
    inner = engine.store.claim
    loop = asyncio.get_running_loop()

    claimed = asyncio.Event()

    async def counted(*args: Any) -> list[Claim]:
        claims.append(loop.time())
        claimed.set()
        return await inner(*args)

    async def claim_after(moment: float) -> None:
        while not (claims and claims[-1] > moment):
            claimed.clear()
            await claimed.wait()

    engine.store.claim = counted  # type: ignore[method-assign]
    flooder = await asyncpg.connect(database_url)
    try:
        await worker.start()
        await asyncio.wait_for(claim_after(0.0), timeout=10)  # the first claim at start
        before = len(claims)
        began = loop.time()
        for n in range(NOTIFIES):  # distinct payloads: PostgreSQL does not fold them into one
            await flooder.execute("SELECT pg_notify($1, $2)", engine.store.channel, str(n))
        # A claim must still follow the flood's last notification (wake-ups are coalesced, not lost).
        await asyncio.wait_for(claim_after(loop.time()), timeout=10)
        elapsed = loop.time() - began
    finally:
        await flooder.close()
        await worker.stop()
    during = len(claims) - before
    # At most one claim per interval while the flood lasted (plus the one it ends with), however many
    # notifications arrived: without coalescing, every notification is a claim (153 for 1,500 in 0.09 s).
    allowed = int(elapsed / interval) + 2
    print(f"{NOTIFIES} notifications in {elapsed:.2f} s -> {during} claim statements")  # noqa: T201
    assert 1 <= during <= allowed, f"{during} claims for {NOTIFIES} notifications in {elapsed:.2f} s"
    gaps = [b - a for a, b in zip(claims[before:], claims[before + 1:], strict=False)]
    assert all(gap >= interval * 0.99 for gap in gaps), sorted(gaps)[:5]  # never two within one interval

