"""A segment's last commit and the claim of the slot it frees go out together.

While the commit that ends a segment is in flight, the claim loop already claims for that slot
(`Worker._decide_and_commit`): a freed slot does not wait one more round trip for its next command.
What it claims runs only once the slot is given back, so at most `concurrency` segments run a handler
or wait for their commit at once (a killed worker repeats at most that many effects).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.store.port import Claim, CommitRequest, Committed
from stepstone.testing import open_engine

one_step: Workflow[Any] = Workflow("one_step_claims", version=1)
RUNNING: dict[str, int] = {"now": 0, "most": 0}
STARTED: list[str] = []


@one_step.step(start=True)
async def work(ctx: StepContext, state: dict[str, Any]) -> None:
    STARTED.append(ctx.instance_id)
    RUNNING["now"] += 1
    RUNNING["most"] = max(RUNNING["most"], RUNNING["now"])
    await asyncio.sleep(0.002)
    RUNNING["now"] -= 1
    state["done"] = True


registry = Registry(one_step)


async def test_the_next_claim_goes_out_while_the_last_commit_is_in_flight(database_url: str) -> None:
    STARTED.clear()
    async with open_engine(database_url, registry, concurrency=1, lease_seconds=30, poll_interval=0.05) as engine:
        first = await engine.client.start(one_step, {})
        second = await engine.client.start(one_step, {})
        held = asyncio.Event()
        release = asyncio.Event()
        claimed: list[str] = []
        second_claimed = asyncio.Event()
        store: Any = engine.store
        commit_one, commit_many, claim = store.commit, store.commit_many, store.claim

        async def hold(requests: list[CommitRequest]) -> None:
            if any(r.claim.instance.id == first for r in requests):
                held.set()
                await release.wait()

        async def one(request: CommitRequest, **kwargs: Any) -> Committed | None:
            await hold([request])
            return await commit_one(request, **kwargs)

        async def many(requests: list[CommitRequest], **kwargs: Any) -> list[Committed | None]:
            await hold(requests)
            return await commit_many(requests, **kwargs)

        async def claiming(*args: Any) -> list[Claim]:
            found = await claim(*args)
            claimed.extend(c.instance.id for c in found)
            if second in claimed:
                second_claimed.set()
            return found

        store.commit, store.commit_many, store.claim = one, many, claiming
        await engine.worker.start()
        try:
            await asyncio.wait_for(held.wait(), 10)
            # The only slot's segment waits for its last commit: the claim loop takes the next START,
            # which runs once the slot is given back.
            await asyncio.wait_for(second_claimed.wait(), 10)
            # Its segment is spawned: it must wait for the only slot (the worker's semaphore), which the first
            # segment holds while its commit is held. Pass the loop until it waits there (a worker that let
            # it through would have started its handler by then).
            slots = engine.worker._slots
            for _ in range(1000):
                if slots._waiters or second in STARTED:
                    break
                await asyncio.sleep(0)
            assert slots._waiters and engine.worker.events.commits == 0 and second not in STARTED
            release.set()
            await engine.worker.events.wait_until(lambda: engine.worker.events.commits >= 2, timeout=10)
        finally:
            release.set()
            await engine.worker.stop()
        assert [await store.status(i) for i in (first, second)] == ["COMPLETED", "COMPLETED"]


async def test_handlers_never_run_more_than_concurrency_at_once(database_url: str) -> None:
    RUNNING.update(now=0, most=0)
    async with open_engine(database_url, registry, concurrency=2, lease_seconds=30, poll_interval=0.05) as engine:
        await engine.client.start_many(one_step, [{}] * 60)
        await engine.worker.start()
        try:
            await engine.worker.events.wait_until(lambda: engine.worker.events.commits >= 60, timeout=60)
        finally:
            await engine.worker.stop()
    assert RUNNING["most"] == 2


async def test_a_renewal_that_crosses_the_last_commit_reports_no_lost_lease(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The last commit lands (and releases the lease) while its reply is held back; renewals run every
    # 0.1 s meanwhile and find the lease gone. That is the segment ending, not a lost lease. The reply is
    # held (a slow network) for three rounds of the lease loop: done right, the loop leaves an ending
    # segment out of its renewals, so the rounds renew nothing and warn of nothing.
    async with open_engine(database_url, registry, concurrency=1, lease_seconds=0.3, poll_interval=0.05) as engine:
        first = await engine.client.start(one_step, {})
        store: Any = engine.store
        commit_one, commit_many = store.commit, store.commit_many
        landed = asyncio.Event()
        events = engine.worker.events

        async def held_reply() -> None:
            landed.set()
            rounds = events.lease_rounds
            await events.wait_until(lambda: events.lease_rounds >= rounds + 3, timeout=10)

        async def one(request: CommitRequest, **kwargs: Any) -> Committed | None:
            result = await commit_one(request, **kwargs)
            await held_reply()
            return result

        async def many(requests: list[CommitRequest], **kwargs: Any) -> list[Committed | None]:
            results = await commit_many(requests, **kwargs)
            await held_reply()
            return results

        store.commit, store.commit_many = one, many
        with caplog.at_level(logging.WARNING, logger="stepstone"):
            await engine.worker.start()
            try:
                await asyncio.wait_for(landed.wait(), 10)
                await engine.worker.events.wait_until(lambda: engine.worker.events.commits >= 1, timeout=10)
            finally:
                await engine.worker.stop()
        assert await store.status(first) == "COMPLETED"
        assert not [r for r in caplog.records if "lost the lease" in r.getMessage()]
