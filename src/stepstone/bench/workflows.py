"""The workflows the benchmarks run, importable by worker subprocesses (`stepstone.bench.worker_proc`).

    bench_three     three action steps that return at once, ~100 bytes of state
    bench_signal    an action step, a wait for signal "go", then a step that records when it started
    bench_hold      one step that, in a holding process, waits on an event (memory, recovery)
    bench_waiting   the pin of the rows `scale` bulk-inserts as waiting instances
    bench_fanout    a map fork over the state list `items`: each branch sleeps its item's seconds
                    (0: returns at once) and writes its own key of `done`; a join, then one step
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import timedelta

from pydantic import BaseModel, Field

from stepstone.authoring.workflow import Registry, StepContext, Workflow

__all__ = ["HOLD", "SIGNAL_SEEN", "BenchState", "FanState", "fanout", "registry", "signal_wf", "three", "waiting"]

PAD = "x" * 80


class BenchState(BaseModel):
    n: int = 0
    payload: str = PAD


three: Workflow[BenchState] = Workflow("bench_three", version=1, state=BenchState)


@three.step(start=True, next="two")
async def one(_ctx: StepContext, state: BenchState) -> None:
    state.n += 1


@three.step(next="three")
async def two(_ctx: StepContext, state: BenchState) -> None:
    state.n += 1


@three.step(name="three")
async def last(_ctx: StepContext, state: BenchState) -> None:
    state.n += 1


signal_wf: Workflow[BenchState] = Workflow("bench_signal", version=1, state=BenchState)

SIGNAL_SEEN: dict[str, float] = {}
"""instance id -> time.monotonic() when its step after the signal started (in this process)."""


@signal_wf.step(start=True, next="await")
async def before(_ctx: StepContext, state: BenchState) -> None:
    state.n += 1


signal_wf.wait("await", signals={"go": "after"}, timeout=timedelta(hours=1), on_timeout="after")


@signal_wf.step()
async def after(ctx: StepContext, state: BenchState) -> None:
    SIGNAL_SEEN[ctx.instance_id] = time.monotonic()
    state.n += 1


@dataclass
class Hold:
    """Set `enabled` in a process whose `bench_hold` handlers must wait until `release` is set."""

    enabled: bool = False
    entered: int = 0
    target: int = 0
    reached: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)


HOLD = Hold()

hold_wf: Workflow[BenchState] = Workflow("bench_hold", version=1, state=BenchState)


@hold_wf.step(start=True)
async def hold(_ctx: StepContext, state: BenchState) -> None:
    if HOLD.enabled:
        HOLD.entered += 1
        if HOLD.entered >= HOLD.target:
            HOLD.reached.set()
        await HOLD.release.wait()
    state.n += 1


waiting: Workflow[BenchState] = Workflow("bench_waiting", version=1, state=BenchState)


@waiting.step(start=True, next="sleep")
async def first(_ctx: StepContext, state: BenchState) -> None:
    state.n += 1


waiting.timer("sleep", delay=timedelta(days=30), next="await")
waiting.wait("await", signals={"go": "last"}, timeout=timedelta(days=30), on_timeout="last")


@waiting.step(name="last")
async def waiting_last(_ctx: StepContext, state: BenchState) -> None:
    state.n += 1


class FanState(BaseModel):
    items: list[float] = Field(default_factory=list)
    done: dict[str, int] = Field(default_factory=dict)
    count: int = 0


fanout: Workflow[FanState] = Workflow("bench_fanout", version=1, state=FanState)
fanout.fork("spread", map_over="items", branch="item", start=True)


@fanout.step(next="gather")
async def item(ctx: StepContext, state: FanState) -> None:
    assert ctx.branch is not None  # a map branch always knows its item
    seconds = float(ctx.branch.item)
    if seconds > 0:
        await asyncio.sleep(seconds)
    state.done[ctx.branch.name] = 1


fanout.join("gather", fork="spread", next="tally")


@fanout.step(next=None)
async def tally(_ctx: StepContext, state: FanState) -> None:
    state.count = len(state.done)


registry = Registry(three, signal_wf, hold_wf, waiting, fanout)
