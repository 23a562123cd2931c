"""Where a handler raised: its failure keeps the frames below the engine's call (file, line, function and the
source line; never local variables), bounded, redacted like the message, and logged once per failed attempt."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

import asyncpg
import pytest
from pydantic import BaseModel

from stepstone import Registry, Retry, StepContext, Workflow
from stepstone.authoring.sensitive import Sensitive
from stepstone.core.failures import MAX_FRAMES, MAX_FRAMES_BYTES, Frame, bounded, traceback_text
from stepstone.observability.logs import JsonFormatter, TextFormatter
from stepstone.testing import Engine, open_engine

HERE = str(Path(__file__))
SOURCE = Path(__file__).read_text().splitlines()


def _line(text: str) -> int:
    """The line of this file that is `text` (once)."""
    [n] = [n for n, line in enumerate(SOURCE, 1) if line.strip() == text]
    return n


class Card(BaseModel):
    card: Annotated[str, Sensitive] = "4111-1111-1111-1111"
    depth: int = 0


class CardDeclined(Exception):
    pass


_RAISING = 'raise CardDeclined(f"card {card} was declined")  # the innermost frame'


def _declined(card: str) -> None:
    raise CardDeclined(f"card {card} was declined")  # the innermost frame


charging: Workflow[Card] = Workflow("frames_charging", version=1, state=Card)


@charging.step(start=True, retry=Retry(max_attempts=2, backoff=0.01))
async def charge(ctx: StepContext, state: Card) -> None:
    _declined(state.card)  # the handler's frame


threaded: Workflow[Card] = Workflow("frames_threaded", version=1, state=Card)


@threaded.step(start=True, retry=Retry(max_attempts=1))
def charge_in_a_thread(ctx: StepContext, state: Card) -> None:  # sync: runs in the worker's thread pool
    _declined(state.card)  # the sync handler's frame


def _down(n: int) -> None:
    if n:
        _down(n - 1)  # a recursion's frame
    raise RecursionError("bottom reached")


deep: Workflow[Card] = Workflow("frames_deep", version=1, state=Card)


@deep.step(start=True, retry=Retry(max_attempts=1))
async def dive(ctx: StepContext, state: Card) -> None:
    _down(state.depth)


registry = Registry(charging, threaded, deep)


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, registry) as e:
        yield e


def _where(frames: list[dict[str, Any]]) -> list[tuple[str, int, str, str]]:
    return [(f["file"], f["line"], f["function"], f["source"]) for f in frames]


async def test_a_failure_keeps_the_frames_of_the_handler_and_of_what_it_called(engine: Engine) -> None:
    iid = await engine.client.start(charging, {})
    await engine.advance(seconds=1)
    info = await engine.client.get(iid)
    assert info.status == "FAILED"
    expected = [
        (HERE, _line(handler := "_declined(state.card)  # the handler's frame"), "charge", handler),
        (HERE, _line(raising := 'raise CardDeclined(f"card {card} was declined")  # the innermost frame'),
         "_declined", raising),
    ]
    assert _where(info.error["frames"]) == expected  # nothing of the engine above the handler
    assert "frames_omitted" not in info.error
    assert info.traceback == "\n".join([  # the client prints it as Python would
        "Traceback (most recent call last):",
        f'  File "{HERE}", line {expected[0][1]}, in charge', f"    {handler}",
        f'  File "{HERE}", line {expected[1][1]}, in _declined', f"    {raising}",
        "CardDeclined: card [redacted] was declined"])
    assert set(info.error["frames"][0]) == {"file", "line", "function", "source"}  # no local variables
    failed = [h["data"] for h in await engine.client.history(iid) if h["kind"] == "STEP_FAILED"]
    assert [(f["attempt"], _where(f["frames"])) for f in failed] == [(1, expected), (2, expected)]
    [stopped] = [h["data"] for h in await engine.client.history(iid) if h["kind"] == "INSTANCE_FAILED"]
    assert _where(stopped["frames"]) == expected


async def test_a_sync_handler_s_frames_start_at_the_handler(engine: Engine) -> None:
    iid = await engine.client.start(threaded, {})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert [f["function"] for f in info.error["frames"]] == ["charge_in_a_thread", "_declined"]


async def test_a_deep_recursion_keeps_its_innermost_frames(engine: Engine) -> None:
    iid = await engine.client.start(deep, {"depth": 100})
    await engine.run_until_idle()
    error = (await engine.client.get(iid)).error
    assert len(error["frames"]) == MAX_FRAMES
    assert error["frames_omitted"] == 102 - MAX_FRAMES  # dive, then 101 calls of _down
    assert error["frames"][-1]["source"] == 'raise RecursionError("bottom reached")'
    assert {f["function"] for f in error["frames"]} == {"_down"}
    assert len(json.dumps(error["frames"]).encode()) <= MAX_FRAMES_BYTES
    assert (traceback_text(error) or "").startswith(
        f"Traceback (most recent call last):\n  ... {102 - MAX_FRAMES} outer frames not kept\n")


def test_frames_are_cut_to_their_byte_cap() -> None:
    long = Frame("/" + "d" * 1000 + "/x.py", 7, "f" * 500, "s" * 1000)
    frames, omitted = bounded([long] * (MAX_FRAMES + 5))
    assert 0 < len(frames) < MAX_FRAMES and omitted == MAX_FRAMES + 5 - len(frames)
    assert len(json.dumps([f.document() for f in frames], ensure_ascii=False).encode()) <= MAX_FRAMES_BYTES
    assert frames[0].file.endswith("/x.py") and frames[0].line == 7  # a file keeps its end


async def test_frames_are_redacted_like_the_message_and_logged_once_per_attempt(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "stepstone")
    iid = await engine.client.start(charging, {})
    await engine.advance(seconds=1)
    info = await engine.client.get(iid)
    secret = Card().card
    assert info.error["message"] == "card [redacted] was declined"
    assert [f["function"] for f in info.error["frames"]] == ["charge", "_declined"]
    stored = json.dumps([info.error, await engine.client.history(iid)], default=str)
    assert secret not in stored
    lines = [r for r in caplog.records if iid in r.getMessage()]
    assert [r.levelname for r in lines] == ["WARNING", "ERROR"]  # the retry's line, then the failure's
    for record in lines:  # the traceback of the stored (redacted) failure, not of the raw exception
        logged = json.loads(JsonFormatter().format(record))
        assert logged["exception"] == traceback_text(info.error) and secret not in json.dumps(logged)
        assert TextFormatter().format(record).split("\n", 1)[1] == logged["exception"]  # as Python's traceback
    assert logged["exception"].endswith("\n    _declined(state.card)  # the handler's frame\n  File "
                                        f'"{HERE}", line {_line(_RAISING)}, in _declined\n    {_RAISING}\n'
                                        "CardDeclined: card [redacted] was declined")


async def test_a_failure_without_frames_still_reads(engine: Engine, database_url: str) -> None:
    """A failure an earlier release stored has no frames: it reads, and shows no traceback."""
    iid = await engine.client.start(threaded, {})
    await engine.run_until_idle()
    older = {k: v for k, v in (await engine.client.get(iid)).error.items() if not k.startswith("frames")}
    conn = await asyncpg.connect(database_url)
    try:  # as a row of the release before frames
        await conn.execute("UPDATE stepstone.instances SET error = $2::jsonb WHERE id = $1::uuid", iid,
                           json.dumps(older))
    finally:
        await conn.close()
    info = await engine.client.get(iid)
    assert info.error == older and traceback_text(info.error) is None
