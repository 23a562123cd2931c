"""Workflows the schedule and flow-limit tests run (module level, so a worker process can import them)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict

from stepstone.authoring.workflow import Registry, StepContext, Workflow


class Job(BaseModel):
    kind: str = "job"
    customer: str = ""
    data: dict[str, Any] = {}


report: Workflow[Job] = Workflow("report", version=1, state=Job)


@report.step(start=True)
async def build(ctx: StepContext, state: Job) -> None:
    state.data["built"] = True


# Stays running until it gets `done`: for overlap policies and flow limits.
long: Workflow[Job] = Workflow("long", version=1, state=Job)


@long.step(start=True, next="hold")
async def begin(ctx: StepContext, state: Job) -> None:
    state.data["began"] = True


long.wait("hold", signals={"done": long.end()})


# Two short steps with a yield between them: for the concurrency limit under load.
busy: Workflow[Job] = Workflow("busy", version=1, state=Job)


@busy.step(start=True, next="second")
async def first(ctx: StepContext, state: Job) -> None:
    await asyncio.sleep(0)


@busy.step
async def second(ctx: StepContext, state: Job) -> None:
    await asyncio.sleep(0)


# Waits for the message `arrived` correlated by its customer: for publishing in the caller's transaction.
parcel: Workflow[Job] = Workflow("parcel", version=1, state=Job)


@parcel.step(start=True, next="await_arrival")
async def dispatch(ctx: StepContext, state: Job) -> None:
    state.data["dispatched"] = True


parcel.wait("await_arrival", messages={"arrived": "received"}, correlation="customer")


@parcel.step(next=None)
async def received(ctx: StepContext, state: Job) -> None:
    assert ctx.signal is not None
    state.data["got"] = ctx.signal.payload


registry = Registry(report, long, busy, parcel)


# A reminder every day, three times: for time skipping.
daily: Workflow[Job] = Workflow("daily", version=1, state=Job)


@daily.step(start=True, next=["wait_a_day", daily.end()])
async def remind(ctx: StepContext, state: Job) -> str:
    state.data["reminders"] = state.data.get("reminders", 0) + 1
    return "wait_a_day" if state.data["reminders"] < 3 else daily.end()


daily.timer("wait_a_day", delay=timedelta(days=1), next="remind")

registry.add(daily)


# Two versions of one workflow whose state models take different inputs: for checking a schedule's input
# against the version its ticks start.
class Old(BaseModel):
    model_config = ConfigDict(extra="forbid")
    a: int


class New(BaseModel):
    model_config = ConfigDict(extra="forbid")
    b: int


def typed(version: int, model: type[BaseModel]) -> Workflow[Any]:
    wf: Workflow[Any] = Workflow("typed", version=version, state=model)

    @wf.step(start=True, next=None)
    def record(ctx: StepContext, state: Any) -> None:
        return None

    return wf
