"""Helpers for testing workflows against a real PostgreSQL: an engine in one object,
a movable database clock, and run-until-idle instead of sleeps.

    async with open_engine(database_url, registry) as engine:
        iid = await engine.client.start(order, {...})
        await engine.run_until_idle()
        await engine.advance(days=3)                 # time skipping: every timer and schedule due fires
        await engine.assert_step_ran(iid, "charge", times=1)

With pytest, the `engine` fixture of the stepstone plugin (`stepstone.testing.plugin`, registered
through the pytest11 entry point) gives each test such an engine on its own database.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from stepstone.authoring.workflow import Registry
from stepstone.client import Client
from stepstone.core.limits import Limits
from stepstone.core.timestamps import MAX_DURATION
from stepstone.errors import ClientClosed, InvalidInput
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.factory import open_store
from stepstone.store.port import Store

__all__ = ["Engine", "StepRuns", "open_engine"]

_COUNTED_KINDS = ("action", "child")  # the step kinds whose handler's completion history records (STEP_COMPLETED)
_MAX_STILL = 1_000  # stops in a row at which the clock did not move: something due now that running leaves
_MAX_STOPS = 1_000_000  # stops that move the clock on (a minutely schedule over a week is 10,080 of them)


@dataclass(frozen=True)
class StepRuns:
    """The completed runs of one step of an instance, from its history: attempts and state patches."""

    step: str
    attempts: list[int]
    patches: list[Any]

    @property
    def times(self) -> int:
        return len(self.attempts)


@dataclass
class Engine:
    """A store, a client and a worker on one database, for tests."""

    store: Store
    client: Client
    worker: Worker

    async def run_until_idle(self) -> None:
        """Run every command that is claimable now, and whatever they make claimable."""
        await self.worker.run_until_idle()

    async def advance(
        self, by: timedelta | float | None = None, *, days: float = 0, hours: float = 0, minutes: float = 0,
        seconds: float = 0,
    ) -> datetime:
        """Time skipping: move the database clock forward for every session, stopping at every timer, retry,
        deadline and schedule tick that comes due on the way, in order, and running what became due there,
        so a daily timer fires three times in `advance(days=3)`. `by` (seconds, or a timedelta) adds to the
        units; `advance(3)` is `advance(seconds=3)`. Returns the new db time. `move_clock` only moves it."""
        total = _forward("advance", by, days=days, hours=hours, minutes=minutes, seconds=seconds)
        target = await self.store.db_now() + total
        still = 0
        for _ in range(_MAX_STOPS):
            await self.run_until_idle()
            now = await self.store.db_now()
            gap = await self._next_due()
            if gap is None or now + timedelta(seconds=gap) > target:
                break
            still = still + 1 if gap <= 0 else 0
            if still > _MAX_STILL:
                raise RuntimeError(f"advance: something was due now {_MAX_STILL} stops in a row and running did "
                                   "not take it (a timer that re-arms itself at once?)")
            await self.store.move_clock(max(gap, 0.0))
        else:
            raise RuntimeError(f"advance: more than {_MAX_STOPS} stops on the way")
        now = await self.store.db_now()
        if target > now:
            await self.store.move_clock((target - now).total_seconds())
        await self.run_until_idle()
        return await self.store.db_now()

    async def move_clock(
        self, by: timedelta | float | None = None, *, days: float = 0, hours: float = 0, minutes: float = 0,
        seconds: float = 0,
    ) -> datetime:
        """Only move the database clock forward, in one jump, running nothing (to land in the middle of
        something: a lease expired, a timer due but not yet fired); returns the new db time."""
        total = _forward("move_clock", by, days=days, hours=hours, minutes=minutes, seconds=seconds)
        return await self.store.move_clock(total.total_seconds())

    async def _next_due(self) -> float | None:
        """Seconds to the next command, lease expiry or schedule tick that comes due, or None."""
        gaps = [await self.store.next_available()]
        if self.worker.schedules is not None:
            gaps.append(await self.worker.schedules.next_tick())
        known = [g for g in gaps if g is not None]
        return min(known) if known else None

    # -- assertions on history --------------------------------------------------------------------

    async def step_runs(self, instance_id: str, step: str) -> StepRuns:
        """How often `step` completed on the instance, with each run's attempt and state patch. A step the
        instance's workflow lacks, or one that runs no handler (a timer, a wait ...), is InvalidInput."""
        await self._check_counted(instance_id, step)
        done = [h for h in await self.client.history(instance_id)
                if h["kind"] == "STEP_COMPLETED" and h["step"] == step]
        data = [h["data"] or {} for h in done]
        return StepRuns(step, [d.get("attempt", 1) for d in data], [d.get("patch") for d in data])

    async def _check_counted(self, instance_id: str, step: str) -> None:
        """Refuse a step that never records a completed run on the instance, so a misspelt name cannot
        pass `times=0`: checked against the instance's workflow version in the engine's registry."""
        info = await self.client.get(instance_id)
        workflow = self.worker.registry.find(info.definition_id, info.version)
        if workflow is None:  # not a workflow this engine runs: nothing to check against
            return
        steps = workflow.plan.steps
        counted = [name for name, s in steps.items() if s.kind in _COUNTED_KINDS]
        what = f"workflow {info.definition_id!r} v{info.version}"
        if step not in steps:
            raise InvalidInput(f"{what} has no step {step!r}; its steps: {', '.join(steps)}", what="step")
        if step not in counted:
            raise InvalidInput(
                f"step {step!r} of {what} is a {steps[step].kind} step: only action and child steps run a handler, "
                f"so only they are counted; its action and child steps: {', '.join(counted) or 'none'}", what="step")

    async def assert_step_ran(
        self, instance_id: str, step: str, *, times: int = 1, patch: Any = None, attempt: int | None = None,
    ) -> StepRuns:
        """Fail unless `step` completed `times` times on the instance; with `patch`, its last run changed the
        state by exactly that RFC 6902 patch; with `attempt`, its last run was that attempt. `step` must be an
        action or child step of the instance's workflow (InvalidInput otherwise, as for `step_runs`)."""
        runs = await self.step_runs(instance_id, step)
        if runs.times != times:
            done = Counter(h["step"] for h in await self.client.history(instance_id) if h["kind"] == "STEP_COMPLETED")
            ran = ", ".join(f"{name} ({n})" for name, n in done.items()) or "none"
            raise AssertionError(f"step {step!r} of instance {instance_id} ran {runs.times} time(s), expected {times}; "
                                 f"the steps that ran (times): {ran}")
        if patch is not None and (not runs.patches or runs.patches[-1] != patch):
            last = runs.patches[-1] if runs.patches else None
            raise AssertionError(f"step {step!r} of instance {instance_id} patched the state with {last!r}, "
                                 f"expected {patch!r}")
        if attempt is not None and (not runs.attempts or runs.attempts[-1] != attempt):
            raise AssertionError(f"step {step!r} of instance {instance_id} last ran as attempt "
                                 f"{runs.attempts[-1] if runs.attempts else None}, expected {attempt}")
        return runs

    def new_worker(self, **config: Any) -> Worker:
        """Another worker on the same store (e.g. to take over an expired lease)."""
        return Worker(self.store, self.worker.registry, WorkerConfig(**config), self.worker.limits)


def _forward(what: str, by: timedelta | float | None, **units: float) -> timedelta:
    """The step `by` (seconds or a timedelta) plus the units; InvalidInput unless 0 to a thousand years."""
    try:
        total: timedelta | None = timedelta(**units)
        if by is not None:
            total = (total or timedelta(0)) + (by if isinstance(by, timedelta) else timedelta(seconds=float(by)))
    except (OverflowError, ValueError, TypeError):  # inf, NaN, 1e300, a string
        total = None
    if total is None or not timedelta(0) <= total <= MAX_DURATION:
        given = f"{total.total_seconds():g} s" if total is not None else repr(
            {k: v for k, v in (("by", by), *units.items()) if v})
        raise InvalidInput(f"{what} moves the clock forward, by 0 to a thousand years; got {given}", what=what)
    return total


@asynccontextmanager
async def open_engine(
    database_url: str,
    registry: Registry,
    *,
    schema: str = "stepstone",
    limits: Limits | None = None,
    **config: Any,
) -> AsyncIterator[Engine]:
    """Open an engine on a migrated database; `config` goes to WorkerConfig. On the way out the database
    clock gets back the offset it had on the way in: `advance` moves it for every session of the database."""
    store = await open_store(database_url, schema, max_size=config.get("concurrency", 8) + 4)
    client = Client(store, registry, limits=limits)
    try:
        offset = await store.clock_offset()
        try:
            worker = Worker(store, registry, WorkerConfig(**config), limits)
            await worker.register()
            yield Engine(store, client, worker)
        finally:
            await _put_back_clock(store, database_url, schema, offset)
    finally:
        await client.detach()
        await store.close()


async def _put_back_clock(store: Store, database_url: str, schema: str, offset: float) -> None:
    """The database clock's offset as `open_engine` found it, written only when a test moved it; through a
    store of its own when the test closed its client (which closes the engine's store)."""
    async def put_back(on: Store) -> None:
        if await on.clock_offset() != offset:
            await on.set_clock_offset(offset)

    try:
        await put_back(store)
    except ClientClosed:
        spare = await open_store(database_url, schema, max_size=1)
        try:
            await put_back(spare)
        finally:
            await spare.close()
