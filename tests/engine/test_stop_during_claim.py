"""Stopping while a claim statement is in flight: what it claimed drains, nothing is orphaned."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from stepstone.store.port import Claim
from stepstone.testing import Engine
from tests.engine import workflows


async def test_a_claim_answered_after_stop_began_is_not_orphaned(engine: Engine) -> None:
    iid = await engine.client.start(workflows.three, {"order_id": "o-1"})
    worker = engine.new_worker(concurrency=2, lease_seconds=30)
    answered = asyncio.Event()
    let_through = asyncio.Event()
    inner = engine.store.claim

    async def slow_answer(*args: Any) -> list[Claim]:
        found = await inner(*args)  # claimed in the database...
        if found:
            answered.set()
            await let_through.wait()  # ...but the worker hears of it only later
        return found

    engine.store.claim = slow_answer  # type: ignore[method-assign]
    await worker.start()
    await asyncio.wait_for(answered.wait(), timeout=10)
    stopping = asyncio.create_task(worker.stop())
    # Scheduled after the stop task's first step: stop() begins while the claim's answer is pending.
    asyncio.get_running_loop().call_soon(let_through.set)
    await asyncio.wait_for(stopping, timeout=30)

    # The claimed command was either run to completion or given back, never left under a lease.
    info = await engine.client.get(iid)
    async with engine.store.pool.acquire() as conn:
        held = await conn.fetchval(
            "SELECT count(*) FROM stepstone.commands WHERE instance_id = $1 AND state = 'CLAIMED'", uuid.UUID(iid)
        )
    assert held == 0, f"a claim was orphaned (instance {info.status} at {info.step})"
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"

