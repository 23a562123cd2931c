"""Workflows the API and UI tests run: a job that can be made to fail, then waits for approval."""

from __future__ import annotations

from pydantic import BaseModel

from stepstone.authoring.workflow import Registry, Retry, StepContext, Workflow


class Job(BaseModel):
    name: str
    log: list[str] = []


FAILING: set[str] = set()
"""Job names whose `charge` step raises (a test clears a name to let its retry pass)."""


class Declined(Exception):
    pass


job: Workflow[Job] = Workflow("job", version=1, state=Job)


@job.step(start=True, next="approval", retry=Retry(max_attempts=1))
def charge(ctx: StepContext, state: Job) -> None:
    if state.name in FAILING:
        raise Declined(f"card declined for {state.name}")
    state.log.append("charged")
    ctx.emit("job.charged", {"name": state.name}, key=state.name)


job.wait("approval", signals={"approve": "ship", "reject": "refund"})


@job.step(next=None)
def ship(ctx: StepContext, state: Job) -> None:
    state.log.append("shipped")


@job.step(next=None)
def refund(ctx: StepContext, state: Job) -> None:
    state.log.append("refunded")


registry = Registry(job)
