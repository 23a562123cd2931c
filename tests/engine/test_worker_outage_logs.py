"""A worker whose database goes away and comes back: the claim loop tells the outage (one warning when it
starts, its failed retries at DEBUG) and its end (one INFO line with the attempts and how long), and the
worker's other loops, which meet the same outage, stay quiet about it instead of interleaving a warning a
second each."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.errors import DatabaseUnavailable
from stepstone.runtime.outage import ClaimOutage
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.postgres import PostgresStore
from stepstone.testing import open_engine
from tests.outages import Outage

flow: Workflow[Any] = Workflow("outage_flow")


@flow.step(start=True, next=None)
def only(ctx: StepContext, state: dict[str, Any]) -> None:
    state["done"] = True


registry = Registry(flow)
QUIET = ("listen_due", "due_schedules", "heartbeat")
"""What the wake-up connection, the schedule firer and the heartbeat call: each must meet the outage."""


class StoreOutage(Outage):
    """The real store, except that while `down` every call the worker's loops make fails."""

    def __init__(self, store: PostgresStore) -> None:
        super().__init__(store, ("claim", *QUIET))
        self.claims_failed = 0
        self.failed_thrice = asyncio.Event()
        self.claimed_again = asyncio.Event()

    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        try:
            self.check("claim")
        except DatabaseUnavailable:
            self.claims_failed += 1
            if self.claims_failed >= 3:
                self.failed_thrice.set()
            raise
        claims = await self.real.claim(*args, **kwargs)
        if self.claims_failed:
            self.claimed_again.set()
        return claims

    async def listen_due(self, *args: Any, **kwargs: Any) -> Any:
        return await self.listening("listen_due", self.real.listen_due, *args, **kwargs)

    async def due_schedules(self, *args: Any, **kwargs: Any) -> Any:
        self.check("due_schedules")
        return await self.real.due_schedules(*args, **kwargs)

    @property
    def definitions(self) -> Any:
        return _Definitions(self, self.real.definitions)


class _Definitions:
    def __init__(self, outage: StoreOutage, real: Any) -> None:
        self._outage, self._real = outage, real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    async def heartbeat(self, *args: Any, **kwargs: Any) -> Any:
        self._outage.check("heartbeat")
        return await self._real.heartbeat(*args, **kwargs)


async def test_an_outage_is_told_by_the_claim_loop_once_each_way(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_engine(database_url, registry) as engine:
        outage = StoreOutage(engine.store)  # type: ignore[arg-type]
        config = WorkerConfig(poll_interval=0.05, heartbeat_seconds=0.05, schedule_interval=0.05)
        worker = Worker(outage, registry, config)  # type: ignore[arg-type]
        with caplog.at_level(logging.DEBUG, logger="stepstone"):
            await worker.start()
            try:
                await outage.take_down()
                await asyncio.wait_for(outage.met.wait(), 30)  # every loop met it, the claim loop at least once
                await asyncio.wait_for(outage.failed_thrice.wait(), 30)  # and the claim loop retried, failing
                outage.down = False
                await asyncio.wait_for(outage.claimed_again.wait(), 30)
                iid = await engine.client.start(flow, {})
                assert (await engine.client.wait_for(iid, timeout=30)).status == "COMPLETED"
            finally:
                await worker.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    claims = [m for m in warnings if m.startswith("claim failed (DatabaseUnavailable")]
    # One warning for the outage, not one per failed claim (a line a retry, up to one every 5 s, for as long
    # as the database was away); the retries are at DEBUG, with the attempts so far.
    assert len(claims) == 1 and outage.claims_failed >= 3, warnings
    assert "(said once while it fails this way: quiet until claims work again)" in claims[0], claims
    retries = [r.getMessage() for r in caplog.records
               if r.levelno == logging.DEBUG and r.getMessage().startswith("claim failed again (DatabaseUnavailable")]
    assert len(retries) == outage.claims_failed - 1, retries
    assert ", 2 attempt(s) over " in retries[0], retries
    # The other loops said it at DEBUG; the wake-up connection may be the first to meet the outage (once).
    others = [m for m in warnings if m not in claims]
    assert len(others) <= 1 and all(m.startswith("wake-up connection unavailable") for m in others), warnings
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    for said in ("wake-up connection unavailable", "firing schedules failed", "heartbeat failed"):
        assert any(m.startswith(said) for m in debug), (said, debug)
    wake_ups = [m for m in (*others, *debug) if m.startswith("wake-up connection unavailable")]
    assert all(m.endswith("; polling every 0.05 s") for m in wake_ups), wake_ups  # as configured, not rounded
    back = [r for r in caplog.records if r.getMessage().startswith("claims work again")]
    assert len(back) == 1 and back[0].levelno == logging.INFO, [r.getMessage() for r in back]
    assert f"after {outage.claims_failed} failed attempt(s) over " in back[0].getMessage()


def test_a_claim_failing_another_way_warns_again(caplog: pytest.LogCaptureFixture) -> None:
    """Within an outage, a retry that fails the same way is DEBUG, one that fails another way (a bug after
    the database came back, say) a warning; after claims work, the next failure warns again."""
    told = ClaimOutage()
    with caplog.at_level(logging.DEBUG, logger="stepstone.worker"):
        for n, exc in enumerate([DatabaseUnavailable("down"), DatabaseUnavailable("down"), ValueError("bug"),
                                 ValueError("bug")]):
            assert 0 < told.failed(exc, float(n)) <= 5.0
        told.worked(10.0)
        told.failed(DatabaseUnavailable("down"), 11.0)
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    expected = [
        ("WARNING", "claim failed (DatabaseUnavailable: down); "), ("DEBUG", "claim failed again (DatabaseUnavailable"),
        ("WARNING", "claim failed (ValueError: bug); "), ("DEBUG", "claim failed again (ValueError: bug), 4 attempt"),
        ("INFO", "claims work again after 4 failed attempt(s) over 10.0 s"),
        ("WARNING", "claim failed (DatabaseUnavailable: down); ")]
    assert len(said) == len(expected) and all(
        level == want and text.startswith(start) for (level, text), (want, start) in zip(said, expected, strict=True)
    ), said
