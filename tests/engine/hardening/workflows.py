"""Workflows of the runtime hardening tests, steered per instance through the dicts below.

`RUNS` counts handler runs per (instance, step); `RAISE` makes a `bang_*` step raise that
exception once; `EMIT` gives `emitter.emit` what to do with the context; `GATE` holds a
sync or async step on an event the test releases.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

from stepstone.authoring.workflow import Registry, Retry, StepContext, Workflow

RUNS: Counter[tuple[str, str]] = Counter()
RAISE: dict[str, BaseException] = {}
EMIT: dict[str, Callable[[StepContext], None]] = {}


class Gate:
    """A handler stops inside itself until the test opens the gate (sync: threading, async: asyncio)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.async_entered = asyncio.Event()
        self.async_opened = asyncio.Event()


GATE: dict[str, Gate] = {}


def _ran(ctx: StepContext) -> None:
    RUNS[ctx.instance_id, ctx.step] += 1


# -- item 1: a step may not leave a state its model forbids ----------------------------------------------


class Strict(BaseModel):
    qty: int = Field(gt=0)
    log: list[str] = []


strict_last: Workflow[Strict] = Workflow("strict_last", state=Strict)


@strict_last.step(next=None)
def spoil_last(ctx: StepContext, state: Strict) -> None:
    _ran(ctx)
    state.qty = -5


strict_mid: Workflow[Strict] = Workflow("strict_mid", state=Strict)


@strict_mid.step(start=True, next="after_spoil")
def spoil_first(ctx: StepContext, state: Strict) -> None:
    _ran(ctx)
    state.log.append("spoiled")
    state.qty = -5


@strict_mid.step(next=None)
def after_spoil(ctx: StepContext, state: Strict) -> None:
    _ran(ctx)
    state.log.append("after")


strict_typed: Workflow[Strict] = Workflow("strict_typed", state=Strict)


@strict_typed.step(next=None)
def mistype(ctx: StepContext, state: Strict) -> None:
    _ran(ctx)
    state.qty = "three"  # type: ignore[assignment]  # a text where the model holds a number


# -- item 2: a handler's BaseException is a step failure ---------------------------------------------------


class Plain(BaseModel):
    log: list[str] = []


def _maybe_raise(ctx: StepContext) -> None:
    exc = RAISE.pop(ctx.instance_id, None)
    if exc is not None:
        raise exc


bang_sync: Workflow[Plain] = Workflow("bang_sync", state=Plain)


@bang_sync.step(next=None, retry=Retry(max_attempts=2, backoff=1.0))
def bang_sync_step(ctx: StepContext, state: Plain) -> None:
    _ran(ctx)
    _maybe_raise(ctx)
    state.log.append(f"ok@{ctx.attempt}")


bang_async: Workflow[Plain] = Workflow("bang_async", state=Plain)


@bang_async.step(next=None, retry=Retry(max_attempts=2, backoff=1.0))
async def bang_async_step(ctx: StepContext, state: Plain) -> None:
    _ran(ctx)
    await asyncio.sleep(0)
    _maybe_raise(ctx)
    state.log.append(f"ok@{ctx.attempt}")


# -- item 15: what a handler emits or raises is checked before the commit -------------------------------


class BadText(Exception):
    """Never retried, so a clean failure shows as one run."""


emitter: Workflow[Plain] = Workflow("emitter", state=Plain)


@emitter.step(next=None, retry=Retry(max_attempts=3, backoff=1.0, non_retryable=(BadText,)))
def emit(ctx: StepContext, state: Plain) -> None:
    _ran(ctx)
    action = EMIT.get(ctx.instance_id)
    if action is not None:
        action(ctx)
    state.log.append("emitted")


CHOOSE: dict[str, Any] = {}
"""instance id -> what `chooser.choose` returns as its next step."""

chooser: Workflow[Plain] = Workflow("chooser", state=Plain)


@chooser.step(start=True, next=["left", "right"])
def choose(ctx: StepContext, state: Plain) -> Any:
    return CHOOSE.get(ctx.instance_id, "left")


@chooser.step(next=None)
def left(ctx: StepContext, state: Plain) -> None:
    state.log.append("left")


@chooser.step(next=None)
def right(ctx: StepContext, state: Plain) -> None:
    state.log.append("right")


# -- items 7 and 20: handlers held on an event ----------------------------------------------------------------


held_sync: Workflow[Plain] = Workflow("held_sync", state=Plain)


@held_sync.step(next=None)
def held_sync_step(ctx: StepContext, state: Plain) -> None:
    _ran(ctx)
    gate = GATE.get(ctx.instance_id)
    if gate is not None:
        gate.entered.set()
        gate.opened.wait(timeout=60)
    state.log.append("held")


held_async: Workflow[Plain] = Workflow("held_async", state=Plain)


@held_async.step(next=None)
async def held_async_step(ctx: StepContext, state: Plain) -> None:
    _ran(ctx)
    gate = GATE.get(ctx.instance_id)
    if gate is not None:
        gate.async_entered.set()
        await gate.async_opened.wait()
    state.log.append("held")
    ctx.emit("held.done", {"instance": ctx.instance_id}, key=ctx.instance_id)


NEVER = threading.Event()
"""Never set: `stuck.stuck_step` blocks on it, standing for a synchronous call that never returns."""

stuck: Workflow[Plain] = Workflow("stuck", state=Plain)


@stuck.step(next=None)
def stuck_step(ctx: StepContext, state: Plain) -> None:
    logging.getLogger("stepstone.tests").warning("stuck handler entered for %s", ctx.instance_id)
    NEVER.wait(timeout=120)


# -- item 18: documented behaviour ------------------------------------------------------------------------


class Due(BaseModel):
    due: str
    log: list[str] = []


until_wf: Workflow[Due] = Workflow("until_wf", state=Due)
until_wf.timer("sleep_until", until="due", next="woke", start=True)


@until_wf.step(next=None)
def woke(ctx: StepContext, state: Due) -> None:
    state.log.append("woke")


gated: Workflow[Plain] = Workflow("gated", state=Plain)
gated.wait("gate", signals={"go": "through"}, timeout=3600, on_timeout="through", start=True)


@gated.step(next=None)
def through(ctx: StepContext, state: Plain) -> None:
    state.log.append(f"through:{ctx.signal.name if ctx.signal else 'timeout'}")


parker: Workflow[Plain] = Workflow("parker", state=Plain)
parker.timer("nap", delay=60, next="listen", start=True)
parker.wait("listen", signals={"go": "through_parker"})


@parker.step(name="through_parker", next=None)
def through_parker(ctx: StepContext, state: Plain) -> None:
    state.log.append("through")


backoff_wf: Workflow[Plain] = Workflow("backoff_wf", state=Plain)


@backoff_wf.step(start=True, next="hold_on", retry=Retry(max_attempts=2, backoff=10.0))
def first_try(ctx: StepContext, state: Plain) -> None:
    _ran(ctx)
    _maybe_raise(ctx)


backoff_wf.wait("hold_on", signals={"go": "through_backoff"})


@backoff_wf.step(name="through_backoff", next=None)
def through_backoff(ctx: StepContext, state: Plain) -> None:
    state.log.append(f"through:{ctx.signal.name if ctx.signal else None}")


KEYS: dict[str, list[tuple[int, str]]] = {}
"""instance id -> (attempt, idempotency key) of every run of `keyed.charge`."""
FAIL_ONCE: set[str] = set()


keyed: Workflow[Plain] = Workflow("keyed", state=Plain)


@keyed.step(next=None, retry=Retry(max_attempts=3, backoff=1.0))
async def charge(ctx: StepContext, state: Plain) -> None:
    KEYS.setdefault(ctx.instance_id, []).append((ctx.attempt, ctx.idempotency_key))
    ctx.emit("charged", {"key": ctx.idempotency_key}, key=ctx.instance_id)
    if ctx.instance_id in FAIL_ONCE:
        FAIL_ONCE.discard(ctx.instance_id)
        raise RuntimeError("the card service timed out")
    gate = GATE.get(ctx.instance_id)
    if gate is not None:
        GATE.pop(ctx.instance_id)
        gate.async_entered.set()
        await gate.async_opened.wait()
    state.log.append("charged")


def steer_reset() -> None:
    CHOOSE.clear()
    KEYS.clear()
    FAIL_ONCE.clear()
    RUNS.clear()
    RAISE.clear()
    EMIT.clear()
    for gate in GATE.values():
        gate.opened.set()
        gate.async_opened.set()
    GATE.clear()


registry = Registry(
    strict_last, strict_mid, strict_typed, bang_sync, bang_async, emitter, held_sync, held_async, stuck,
    until_wf, gated, keyed, parker, backoff_wf, chooser,
)


def payload_of(size: int) -> dict[str, Any]:
    return {"blob": "x" * size}
