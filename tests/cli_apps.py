"""Workflows the CLI tests load with ``--app tests.cli_apps:registry``."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

from pydantic import BaseModel

from stepstone.authoring.workflow import CompensationContext, Registry, Retry, StepContext, Workflow

# Under "stepstone", so `stepstone worker` writes it to stderr with its own lines: a test reads it there.
log = logging.getLogger(f"stepstone.{__name__}")


class Greeting(BaseModel):
    name: str
    greeting: str | None = None


hello: Workflow[Greeting] = Workflow("hello", state=Greeting)


@hello.step(next=None)
def greet(ctx: StepContext, state: Greeting) -> None:
    state.greeting = f"hello {state.name}"


class Approval(BaseModel):
    approved_by: Any = None


approval: Workflow[Approval] = Workflow("approval", state=Approval)
approval.wait("decide", signals={"approve": "done"}, start=True)


@approval.step(next=None)
def done(ctx: StepContext, state: Approval) -> None:
    state.approved_by = ctx.signal.payload if ctx.signal else None


class Outcome(BaseModel):
    ok: bool = False


FLAKY = {"fail": True}
flaky: Workflow[Outcome] = Workflow("flaky", state=Outcome)


@flaky.step(next=None, retry=Retry(max_attempts=1))
def attempt(ctx: StepContext, state: Outcome) -> None:
    if FLAKY["fail"]:
        raise RuntimeError("the service said no")
    state.ok = True


class Nap(BaseModel):
    seconds: float = 0
    napped: bool = False


slow: Workflow[Nap] = Workflow("slow", state=Nap)


@slow.step(next=None)
async def nap(ctx: StepContext, state: Nap) -> None:
    log.info("step of %s in flight", ctx.instance_id)
    # Stands for a long call to the outside world, so a drain has something in flight.
    await asyncio.sleep(state.seconds)
    state.napped = True


class Held(BaseModel):
    done: bool = False


held: Workflow[Held] = Workflow("held", state=Held)


@held.step(next=None)
def hold(ctx: StepContext, state: Held) -> None:
    log.info("step of %s in flight", ctx.instance_id)
    # In flight until the test writes a line to the worker's stdin (or closes it): a drain is tested on a
    # step that is certainly still running.
    sys.stdin.readline()
    state.done = True


class Refund(BaseModel):
    refunded: bool = False


# A saga whose compensation fails while REFUNDS_DOWN holds: `pay`, then `ship` fails for good, so `pay`
# is compensated by `refund`; with the refund service down the instance stops at COMPENSATION_FAILED.
REFUNDS_DOWN = {"down": True}
refund_saga: Workflow[Refund] = Workflow("refund_saga", state=Refund)


@refund_saga.step(start=True, next="ship")
def pay(ctx: StepContext, state: Refund) -> None:
    ctx.record("pay-1")


@refund_saga.compensation("pay", retry=Retry(max_attempts=1))
def refund(ctx: CompensationContext, state: Refund, recorded: Any) -> None:
    if REFUNDS_DOWN["down"]:
        raise ConnectionError("refund service unavailable")
    state.refunded = True


@refund_saga.step(next=None, retry=Retry(max_attempts=1))
def ship(ctx: StepContext, state: Refund) -> None:
    raise RuntimeError("warehouse closed")


registry = Registry(hello, approval, flaky, slow, held, refund_saga)
not_a_registry = 42
