"""Workflows the engine tests run. Module level, so a worker in another process can import them.

Handlers are steered per instance through the module-level dicts below (a test sets them
before the instance runs): `FAILURES` makes `flaky` raise that many times, `HOLD` makes
`slow`/`three`'s second step wait on an event the first time it runs for an instance.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from pydantic import BaseModel

from stepstone.authoring.workflow import Registry, Retry, StepContext, Workflow


class Order(BaseModel):
    order_id: str
    log: list[str] = []
    data: dict[str, Any] = {}


class Flaky(Exception):
    """A retryable handler error."""


class Fatal(Exception):
    """An error the retry policy never retries."""


FAILURES: dict[str, int] = {}
"""instance id -> how many more times `flaky.work` raises Flaky."""


class Hold:
    """Makes a handler stop inside itself until the test releases it."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.finished = False


HOLD: dict[str, Hold] = {}
"""instance id -> the hold the next run of a holding step waits on (taken once)."""


async def _maybe_hold(ctx: StepContext) -> None:
    hold = HOLD.pop(ctx.instance_id, None)
    if hold is not None:
        hold.entered.set()
        await hold.release.wait()
        hold.finished = True


# -- three steps: a -> b -> c -> end; b can be held -------------------------------------------------

three: Workflow[Order] = Workflow("three", version=1, state=Order)


@three.step(start=True, next="b")
def a(ctx: StepContext, state: Order) -> None:
    state.log.append("a")


@three.step(next="c")
async def b(ctx: StepContext, state: Order) -> None:
    await _maybe_hold(ctx)
    state.log.append("b")
    ctx.emit("b.done", {"order": state.order_id}, key=state.order_id)


@three.step(next=None)
def c(ctx: StepContext, state: Order) -> None:
    state.log.append("c")


# -- a timer between two actions ------------------------------------------------------------------

timed: Workflow[Order] = Workflow("timed", version=1, state=Order)


@timed.step(start=True, next="nap")
def before(ctx: StepContext, state: Order) -> None:
    state.log.append("before")


timed.timer("nap", delay=timedelta(minutes=5), next="after")


@timed.step(next=None)
def after(ctx: StepContext, state: Order) -> None:
    state.log.append("after")


# -- signals: timer -> wait(go) -> mid -> wait(later) -> finish ----------------------------------------

signals: Workflow[Order] = Workflow("signals", version=1, state=Order)
signals.timer("nap", delay=60, next="first_wait", start=True)
signals.wait("first_wait", signals={"go": "mid"})


@signals.step(next="second_wait")
def mid(ctx: StepContext, state: Order) -> None:
    state.log.append(f"mid:{ctx.signal.name if ctx.signal else None}:{ctx.signal.payload if ctx.signal else None}")


signals.wait("second_wait", signals={"later": "finish"})


@signals.step(next=None)
def finish(ctx: StepContext, state: Order) -> None:
    state.log.append(f"finish:{ctx.signal.name if ctx.signal else None}")


# -- retries -------------------------------------------------------------------------------------

BACKOFF = 10.0

flaky: Workflow[Order] = Workflow("flaky", version=1, state=Order)


@flaky.step(start=True, next="done", retry=Retry(max_attempts=3, backoff=BACKOFF, non_retryable=(Fatal,)))
async def work(ctx: StepContext, state: Order) -> None:
    left = FAILURES.get(ctx.instance_id, 0)
    if left == -1:
        raise Fatal("card declined for good")
    if left > 0:
        FAILURES[ctx.instance_id] = left - 1
        raise Flaky(f"upstream busy (attempt {ctx.attempt})")
    state.log.append(f"work@{ctx.attempt}")


@flaky.step(next=None)
def done(ctx: StepContext, state: Order) -> None:
    state.log.append("done")


# -- a wait as the very first step ---------------------------------------------------------------

waiter: Workflow[Order] = Workflow("waiter", version=1, state=Order)
waiter.wait("parked", signals={"go": "wrap_up"}, start=True)


@waiter.step(next=None)
def wrap_up(ctx: StepContext, state: Order) -> None:
    state.log.append("wrapped")


registry = Registry(three, timed, signals, flaky, waiter)
