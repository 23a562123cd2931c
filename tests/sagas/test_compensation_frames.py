"""Where a compensation handler raised: each failed attempt, the saga's record, the instance's error and
the compensation-failed alert (hook and outbox event) keep its frames as a failed step does (`core.failures`),
and the alert and the saga's record are redacted like the history."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

import asyncpg
import pytest
from pydantic import BaseModel

from stepstone import CompensationContext, Registry, Retry, StepContext, Workflow
from stepstone.authoring.sensitive import Sensitive
from stepstone.core.failures import traceback_text
from stepstone.testing import Engine, open_engine

HERE = str(Path(__file__))
SOURCE = Path(__file__).read_text().splitlines()
ALERTS: list[dict[str, Any]] = []


def _line(text: str) -> int:
    [n] = [n for n, line in enumerate(SOURCE, 1) if line.strip() == text]
    return n


class Refund(BaseModel):
    card: Annotated[str, Sensitive] = "4111-1111-1111-1111"


class RefundRefused(Exception):
    pass


_RAISING = 'raise RefundRefused(f"card {card} refused the refund")  # the innermost frame'


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


async def test_a_compensation_that_raises_keeps_its_frames_redacted_everywhere_it_is_told(
    engine: Engine, conn: asyncpg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="stepstone.worker")
    iid = await engine.client.start(refunding, {})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPENSATION_FAILED"
    expected = [
        {"file": HERE, "line": _line(called := "_refuse(state.card)  # the compensation's frame"),
         "function": "refund", "source": called},
        {"file": HERE, "line": _line(raised := _RAISING), "function": "_refuse", "source": raised},
    ]
    last = {"type": "RefundRefused", "message": "card [redacted] refused the refund", "frames": expected}
    history = await engine.client.history(iid)
    attempts = [h["data"]["error"] for h in history if h["kind"] == "COMPENSATION_ATTEMPT_FAILED"]
    assert attempts == [last]
    [given_up] = [h["data"] for h in history if h["kind"] == "COMPENSATION_FAILED"]
    assert given_up["last_error"] == last
    assert info.error is not None and info.error["error"] == last  # the instance's error, from the saga's record
    assert [c["last_error"] for c in await engine.client.compensations(iid)] == [last]
    [alert] = ALERTS
    assert alert["last_error"] == last  # the hook: what existed before, plus the frames
    [event] = await conn.fetch("SELECT payload FROM stepstone.outbox WHERE type = 'stepstone.compensation_failed'")
    assert json.loads(event["payload"])["last_error"] == last
    stored = json.dumps([dict(r) for r in await conn.fetch("SELECT * FROM stepstone.compensations")], default=str)
    assert "4111" not in stored
    assert traceback_text(info.error) == "\n".join([  # `stepstone show`, the API, the UI, `info.traceback`
        "Traceback (most recent call last):",
        f'  File "{HERE}", line {expected[0]["line"]}, in refund', f"    {called}",
        f'  File "{HERE}", line {expected[1]["line"]}, in _refuse', f"    {raised}",
        "RefundRefused: card [redacted] refused the refund"])
    logged = [r for r in caplog.records if r.getMessage().startswith("compensation of step charge")]
    assert [r.exc_text for r in logged] == [traceback_text(info.error)] * 2  # the attempt retried, the one given up


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
