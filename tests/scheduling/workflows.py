"""Workflows the schedule and flow-limit tests run (module level, so a worker process can import them)."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel

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


registry = Registry(report, long, busy)
