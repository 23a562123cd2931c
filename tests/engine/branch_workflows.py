"""Workflows with forks, joins and children for the engine tests."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from pydantic import BaseModel, Field

from stepstone import END, Registry, Retry, StepContext, Workflow


class Fan(BaseModel):
    items: Any = Field(default_factory=lambda: [1, 2, 3])
    results: dict[str, int] = Field(default_factory=dict)
    counter: int = 0
    log: list[str] = Field(default_factory=list)
    child: dict[str, Any] | None = None


# -- a static fork: two branches, one of them two steps long, joined by all ---------------------

static: Workflow[Fan] = Workflow("static_fork", version=1, state=Fan)
static.fork("split", branches={"left": "left_a", "right": "right_a"}, start=True)


@static.step(next="left_b")
def left_a(ctx: StepContext, state: Fan) -> None:
    state.results["left_a"] = 1


@static.step(next="together")
def left_b(ctx: StepContext, state: Fan) -> None:
    state.results["left_b"] = 2


@static.step(next="together")
def right_a(ctx: StepContext, state: Fan) -> None:
    assert ctx.branch is not None
    state.results[f"right_a:{ctx.branch.name}"] = 3


static.join("together", fork="split", next="after")


@static.step(next=None)
def after(ctx: StepContext, state: Fan) -> None:
    state.log.append(f"after:{len(state.results)}")


# -- a map fork over state.items, results written to disjoint keys -------------------------------

mapped: Workflow[Fan] = Workflow("mapped", version=1, state=Fan)
mapped.fork("each", map_over="items", branch="square", max_items=50, start=True)


@mapped.step(next="all_done")
def square(ctx: StepContext, state: Fan) -> None:
    assert ctx.branch is not None
    state.results[ctx.branch.name] = int(ctx.branch.item) ** 2


mapped.join("all_done", fork="each", next="sum_up")


@mapped.step(next=None)
def sum_up(ctx: StepContext, state: Fan) -> None:
    state.counter = sum(state.results.values())


# -- two branches that change the same field: both updates must land -----------------------------

BARRIER: dict[str, threading.Barrier] = {}

overlap: Workflow[Fan] = Workflow("overlap", version=1, state=Fan)
overlap.fork("both", branches={"a": "bump", "b": "bump"}, start=True)


@overlap.step(next="met")
def bump(ctx: StepContext, state: Fan) -> None:
    barrier = BARRIER.get("overlap")
    if barrier is not None:
        # Both branches read the same state version before either commits (first runs only: the barrier
        # is gone once they have met, so the one the conflict refused runs again at once).
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=10)
        BARRIER.pop("overlap", None)
    state.counter += 1
    state.log.append(f"bump:{ctx.branch.name if ctx.branch else '?'}")


overlap.join("met", fork="both", next="finish")


@overlap.step(next=None)
def finish(ctx: StepContext, state: Fan) -> None:
    state.log.append("finish")


# -- a conflict whose re-run changes nothing, then a step after it in the same segment ------------

claim_once: Workflow[Fan] = Workflow("claim_once", version=1, state=Fan)
claim_once.fork("both", branches={"a": "claim_a", "b": "claim_b"}, start=True)


A_COMMITTED = threading.Event()
"""Set by the test when branch a's commit has returned: b's first run waits for it, so b is refused."""


def _claim(ctx: StepContext, state: Fan, owner: int) -> None:
    barrier = BARRIER.get("claim_once")
    if barrier is not None:  # both read the same state before either commits (first runs only)
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=10)
        if owner == 2:
            A_COMMITTED.wait(timeout=10)
            BARRIER.pop("claim_once", None)
    if "owner" not in state.results:  # b, run again on fresh state, finds it taken: no change this time
        state.results["owner"] = owner


@claim_once.step(next="park")
def claim_a(ctx: StepContext, state: Fan) -> None:
    _claim(ctx, state, 1)


claim_once.wait("park", signals={"go": "met"})


@claim_once.step(next="note")
def claim_b(ctx: StepContext, state: Fan) -> None:
    _claim(ctx, state, 2)


@claim_once.step(next="met")
def note(ctx: StepContext, state: Fan) -> None:
    state.log.append("note")


claim_once.join("met", fork="both", next=END)


# -- join any: the fast branch wins, the waiting one is cancelled --------------------------------

race: Workflow[Fan] = Workflow("race", version=1, state=Fan)
race.fork("contest", branches={"fast": "sprint", "slow": "hold"}, start=True)


@race.step(next="first")
def sprint(ctx: StepContext, state: Fan) -> None:
    state.log.append("sprint")


race.wait("hold", signals={"go": "crawl"})


@race.step(next="first")
def crawl(ctx: StepContext, state: Fan) -> None:
    state.log.append("crawl")


race.join("first", fork="contest", next="won", need="any")


@race.step(next=None)
def won(ctx: StepContext, state: Fan) -> None:
    state.log.append("won")


# -- a branch that waits for a signal addressed to it --------------------------------------------

gated: Workflow[Fan] = Workflow("gated", version=1, state=Fan)
gated.fork("gates", branches={"g1": "gate", "g2": "gate"}, start=True)
gated.wait("gate", signals={"open": "passed"})


@gated.step(next="through")
def passed(ctx: StepContext, state: Fan) -> None:
    assert ctx.branch is not None and ctx.signal is not None
    state.log.append(f"{ctx.branch.name}:{ctx.signal.payload}")


gated.join("through", fork="gates", next="closed")


@gated.step(next=None)
def closed(ctx: StepContext, state: Fan) -> None:
    state.log.append("closed")


# -- a fork inside a branch, a timer inside a branch, a branch that fails until told not to ------

FLAKY_BRANCH: set[str] = set()

nested: Workflow[Fan] = Workflow("nested", version=1, state=Fan)
nested.fork("outer", branches={"x": "inner", "y": "nap"}, start=True)
nested.fork("inner", branches={"p": "leaf", "q": "leaf"})


@nested.step(next="inner_done", retry=Retry(max_attempts=1))
def leaf(ctx: StepContext, state: Fan) -> None:
    assert ctx.branch is not None
    if ctx.branch.path in FLAKY_BRANCH:
        raise RuntimeError(f"{ctx.branch.path} is down")
    state.results[ctx.branch.path] = 1


nested.join("inner_done", fork="inner", next="outer_done")
nested.timer("nap", delay=60, next="outer_done")
nested.join("outer_done", fork="outer", next="end_nested")


@nested.step(next=None)
def end_nested(ctx: StepContext, state: Fan) -> None:
    state.log.append("nested done")


looping: Workflow[Fan] = Workflow("looping", version=1, state=Fan)
looping.fork("round", branches={"a": "tick", "b": "tick"}, start=True)


@looping.step(next="round_done")
def tick(ctx: StepContext, state: Fan) -> None:
    assert ctx.branch is not None
    state.results[f"{ctx.branch.name}{state.counter}"] = 1


looping.join("round_done", fork="round", next="again")


@looping.step(next=["round", END])
def again(ctx: StepContext, state: Fan) -> str:
    state.counter += 1
    return "round" if state.counter < 3 else END


# -- children -------------------------------------------------------------------------------------


class Job(BaseModel):
    n: int = 0
    fail: bool = False
    wait: bool = False
    out: int | None = None


job: Workflow[Job] = Workflow("job", version=1, state=Job)
FLAKY_JOBS: set[int] = set()
"""Jobs (by `n`) that fail while their number is here: a retry after removing it completes them."""
PARKED_JOBS: set[int] = set()
"""Jobs (by `n`) that wait for the signal "done" after their work."""


@job.step(start=True, next=[END, "parked"], retry=Retry(max_attempts=1))
def work(ctx: StepContext, state: Job) -> str:
    if state.fail or state.n in FLAKY_JOBS:
        raise ValueError(f"job {state.n} refused")
    state.out = state.n * 10
    return "parked" if state.wait or state.n in PARKED_JOBS else END


job.wait("parked", signals={"done": END})


parent: Workflow[Job] = Workflow("parent", version=1, state=Job)


@parent.child(workflow="job", next="use", on_failure="recover", start=True)
def spawn(ctx: StepContext, state: Job) -> Job:
    return Job(n=state.n, fail=state.fail, wait=state.wait)


@parent.step(next=None)
def use(ctx: StepContext, state: Job) -> None:
    assert ctx.child is not None and ctx.child.status == "COMPLETED"
    state.out = ctx.child.state["out"]


@parent.step(next=None)
def recover(ctx: StepContext, state: Job) -> None:
    assert ctx.child is not None
    state.out = -1


strict_parent: Workflow[Job] = Workflow("strict_parent", version=1, state=Job)


@strict_parent.child(workflow="job", next="use_it", start=True)
def spawn_strict(ctx: StepContext, state: Job) -> Job:
    return Job(n=state.n, fail=state.fail, wait=state.wait)


@strict_parent.step(next=None)
def use_it(ctx: StepContext, state: Job) -> None:
    assert ctx.child is not None and ctx.child.status == "COMPLETED"
    state.out = ctx.child.state["out"]


abandoning: Workflow[Job] = Workflow("abandoning", version=1, state=Job)


@abandoning.child(workflow="job", next="use_too", cancel_with_parent=False, start=True)
def spawn_free(ctx: StepContext, state: Job) -> Job:
    return Job(n=state.n, wait=True)


@abandoning.step(next=None)
def use_too(ctx: StepContext, state: Job) -> None:
    state.out = 0


# A job that runs its work only on its signal "go": its parent waits for it before it fails (or completes).
late_job: Workflow[Job] = Workflow("late_job", version=1, state=Job)
late_job.wait("hold", signals={"go": "late_work"}, start=True)


@late_job.step(next=None, retry=Retry(max_attempts=1))
def late_work(ctx: StepContext, state: Job) -> None:
    if state.n in FLAKY_JOBS:
        raise ValueError(f"job {state.n} refused")
    state.out = state.n * 10


late_parent: Workflow[Job] = Workflow("late_parent", version=1, state=Job)


@late_parent.child(workflow="late_job", next="late_use", on_failure="late_recover", start=True)
def late_spawn(ctx: StepContext, state: Job) -> Job:
    return Job(n=state.n)


@late_parent.step(next=None)
def late_use(ctx: StepContext, state: Job) -> None:
    assert ctx.child is not None and ctx.child.status == "COMPLETED"
    state.out = ctx.child.state["out"]


@late_parent.step(next=None)
def late_recover(ctx: StepContext, state: Job) -> None:
    state.out = -1


late_strict: Workflow[Job] = Workflow("late_strict", version=1, state=Job)


@late_strict.child(workflow="late_job", next="late_take", start=True)
def late_spawn_strict(ctx: StepContext, state: Job) -> Job:
    return Job(n=state.n)


@late_strict.step(next=None)
def late_take(ctx: StepContext, state: Job) -> None:
    assert ctx.child is not None and ctx.child.status == "COMPLETED"
    state.out = ctx.child.state["out"]


# Two branches, each starting a job (n and n + 1) without a failure route, joined by all.
fan_jobs: Workflow[Fan] = Workflow("fan_jobs", version=1, state=Fan)
fan_jobs.fork("fan", branches={"x": "job_x", "y": "job_y"}, start=True)


@fan_jobs.child(workflow="job", next="took")
def job_x(ctx: StepContext, state: Fan) -> Job:
    return Job(n=state.counter)


@fan_jobs.child(workflow="job", next="took")
def job_y(ctx: StepContext, state: Fan) -> Job:
    return Job(n=state.counter + 1)


@fan_jobs.step(next="fanned")
def took(ctx: StepContext, state: Fan) -> None:
    assert ctx.branch is not None and ctx.child is not None and ctx.child.status == "COMPLETED"
    state.results[ctx.branch.name] = ctx.child.state["out"]


fan_jobs.join("fanned", fork="fan", next="sum_jobs")


@fan_jobs.step(next=None)
def sum_jobs(ctx: StepContext, state: Fan) -> None:
    state.counter = sum(state.results.values())

registry = Registry(
    static, mapped, overlap, claim_once, race, gated, nested, looping, job, parent, strict_parent, abandoning,
    fan_jobs, late_job, late_parent, late_strict,
)
