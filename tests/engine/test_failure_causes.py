"""A handler's error raised from another (`raise X from Y`) or while handling one keeps that cause, as
Python prints it ("The above exception was the direct cause of the following exception"), within the
same caps as the frames (`core.failures`), redacted like the message."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated

import pytest
from pydantic import BaseModel

from stepstone import Registry, Retry, StepContext, Workflow
from stepstone.authoring.sensitive import Sensitive
from stepstone.core import failures
from stepstone.core.failures import MAX_FRAMES, traceback_text
from stepstone.runtime.handlers import raised
from stepstone.testing import Engine, open_engine

HERE = str(Path(__file__))
LINES = {line.strip(): n for n, line in enumerate(Path(__file__).read_text().splitlines(), 1)}


def _line(text: str) -> int:
    return LINES[text]


class Card(BaseModel):
    how: str = "from"
    card: Annotated[str, Sensitive] = "4111-1111-1111-1111"


class CardDeclined(Exception):
    pass


def _lookup(card: str) -> None:
    raise KeyError(card)  # the cause's frame


charging: Workflow[Card] = Workflow("causes_charging", version=1, state=Card)


@charging.step(start=True, retry=Retry(max_attempts=1))
async def charge(ctx: StepContext, state: Card) -> None:
    try:
        _lookup(state.card)  # the handler's call that failed first
    except KeyError as exc:
        if state.how == "from":
            raise CardDeclined("no such card") from exc  # raised from the cause
        if state.how == "none":
            raise CardDeclined("no such card") from None  # its cause suppressed
        raise CardDeclined("no such card")  # noqa: B904 - raised while handling the cause


registry = Registry(charging)


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, registry) as e:
        yield e


def _frame(function: str, source: str) -> dict[str, object]:
    return {"file": HERE, "line": _line(source), "function": function, "source": source}


CAUSE_FRAMES = [_frame("charge", "_lookup(state.card)  # the handler's call that failed first"),
                _frame("_lookup", "raise KeyError(card)  # the cause's frame")]


async def test_an_error_raised_from_another_keeps_its_cause_redacted_and_prints_it_first(engine: Engine) -> None:
    iid = await engine.client.start(charging, {})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.error["cause"] == {"type": "KeyError", "message": "'[redacted]'", "frames": CAUSE_FRAMES}
    raised_at = "raise CardDeclined(\"no such card\") from exc  # raised from the cause"
    assert info.error["frames"] == [_frame("charge", raised_at)]
    assert info.traceback == "\n".join([
        "Traceback (most recent call last):",
        f'  File "{HERE}", line {_line(CAUSE_FRAMES[0]["source"])}, in charge', f"    {CAUSE_FRAMES[0]['source']}",
        f'  File "{HERE}", line {_line(CAUSE_FRAMES[1]["source"])}, in _lookup', f"    {CAUSE_FRAMES[1]['source']}",
        "KeyError: '[redacted]'",
        "",
        "The above exception was the direct cause of the following exception:",
        "",
        "Traceback (most recent call last):",
        f'  File "{HERE}", line {_line(raised_at)}, in charge', f"    {raised_at}",
        "CardDeclined: no such card"])
    [failed] = [h["data"] for h in await engine.client.history(iid) if h["kind"] == "STEP_FAILED"]
    assert failed["cause"] == info.error["cause"]


async def test_an_error_raised_while_handling_another_keeps_it_as_its_context(engine: Engine) -> None:
    iid = await engine.client.start(charging, {"how": "context"})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.error["cause"] == {"type": "KeyError", "message": "'[redacted]'", "frames": CAUSE_FRAMES,
                                   "context": True}
    assert "\nDuring handling of the above exception, another exception occurred:\n" in (info.traceback or "")


async def test_an_error_raised_from_none_keeps_no_cause(engine: Engine) -> None:
    iid = await engine.client.start(charging, {"how": "none"})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert "cause" not in info.error
    assert "KeyError" not in (info.traceback or "")


def _raise_deep(n: int, link: int, cause: BaseException | None) -> None:
    if n:
        _raise_deep(n - 1, link, cause)
    raise ValueError(f"link {link}") from cause


def _chain(links: int, depth: int) -> BaseException:
    """An error raised from `links` - 1 others, each at the bottom of a recursion `depth` deep (`depth` + 2
    frames: the call here, then `depth` + 1 of `_raise_deep`)."""
    error: BaseException | None = None
    for n in range(links):
        try:
            _raise_deep(depth, n, error)
        except ValueError as exc:
            error = exc
    assert error is not None
    return error


def test_a_chain_stays_within_the_frames_caps_and_its_length() -> None:
    failure = raised(_chain(10, 30), retryable=True)
    kept, links, cause = len(failure.frames), 0, failure.cause
    while cause is not None:
        links += 1
        kept += len(cause.get("frames", []))
        cause = cause.get("cause")
    assert len(failure.frames) == MAX_FRAMES and failure.frames_omitted == 32 - MAX_FRAMES  # the error raised first
    assert kept == MAX_FRAMES and links == failures.MAX_CAUSES
    assert failure.cause is not None and failure.cause["message"] == "link 8"
    assert failure.cause["frames_omitted"] == 32 and "frames" not in failure.cause  # no frame left for it
    text = traceback_text({"type": "ValueError", "message": "link 9", "frames": [f.document() for f in failure.frames],
                           "cause": failure.cause})
    assert text is not None and text.count("The above exception was the direct cause") == failures.MAX_CAUSES


def test_a_cycle_of_contexts_ends() -> None:
    first, second = ValueError("first"), KeyError("second")
    try:
        raise first
    except ValueError as a:
        try:
            raise second
        except KeyError as b:
            a.__context__ = b  # a cycle: first -> second -> first
            failure = raised(a, retryable=True)
    assert failure.cause is not None and failure.cause["type"] == "KeyError"
    assert "cause" not in failure.cause
