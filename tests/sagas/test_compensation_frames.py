"""A compensation handler's error: the compensation's record, the instance's error and the
compensation-failed alert (hook and outbox event) are redacted like the history."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

import asyncpg
import pytest
from pydantic import BaseModel

from stepstone import CompensationContext, Registry, Retry, StepContext, Workflow
from stepstone.authoring.sensitive import Sensitive
from stepstone.testing import Engine, open_engine

ALERTS: list[dict[str, Any]] = []


class Refund(BaseModel):
    card: Annotated[str, Sensitive] = "4111-1111-1111-1111"


class RefundRefused(Exception):
    pass


def _refuse(card: str) -> None:
    raise RefundRefused(f"card {card} refused the refund")  # the innermost frame


refunding: Workflow[Refund] = Workflow("comp_frames", version=1, state=Refund)


@refunding.step(start=True, next="ship")
def charge(ctx: StepContext, state: Refund) -> None:
    ctx.record("charged")


@refunding.step(next=None, retry=Retry(max_attempts=1))
def ship(ctx: StepContext, state: Refund) -> None:
    raise RuntimeError("nothing to ship")


@refunding.compensation("charge", retry=Retry(max_attempts=2, backoff=0))
def refund(ctx: CompensationContext, state: Refund, recorded: Any) -> None:  # sync: the worker's threads
    _refuse(state.card)  # the compensation's frame


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    ALERTS.clear()
    async with open_engine(database_url, Registry(refunding), on_compensation_failed=ALERTS.append) as e:
        yield e


async def test_a_compensation_s_error_is_redacted_in_the_instance_s_error_its_record_and_the_alert(
    engine: Engine, conn: asyncpg.Connection
) -> None:
    """The history entries were redacted, but the compensation's record (`compensations`), the instance's
    error built from it and the alert (hook and outbox event) kept the message as raised: a sensitive
    value the compensation put in its error read in full in `stepstone show` and in the event."""
    iid = await engine.client.start(refunding, {})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPENSATION_FAILED"
    shown = "card [redacted] refused the refund"
    assert info.error is not None and info.error["error"]["message"] == shown
    assert [c["last_error"]["message"] for c in await engine.client.compensations(iid)] == [shown]
    [alert] = ALERTS
    assert alert["last_error"]["message"] == shown
    events = await conn.fetch("SELECT payload FROM stepstone.outbox WHERE type = 'stepstone.compensation_failed'")
    assert [json.loads(e["payload"])["last_error"]["message"] for e in events] == [shown]
    everything = json.dumps([dict(r) for r in await conn.fetch("SELECT * FROM stepstone.compensations")], default=str)
    assert "4111" not in everything
