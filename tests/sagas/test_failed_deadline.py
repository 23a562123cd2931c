"""An instance deadline and a FAILED instance: the deadline bounds running, not an operator's repair."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import asyncpg
from pydantic import BaseModel

from stepstone.authoring.workflow import Registry, Retry, StepContext, Workflow
from stepstone.testing import open_engine


class Job(BaseModel):
    done: bool = False


FLAKY: dict[str, bool] = {"broken": True}

chore: Workflow[Job] = Workflow("chore", version=1, state=Job, deadline=timedelta(minutes=10))


@chore.step(start=True, next=None, retry=Retry(max_attempts=1))
def work(ctx: StepContext, state: Job) -> None:
    if FLAKY["broken"]:
        raise RuntimeError("the service is down")
    state.done = True


async def test_a_failed_instance_past_its_deadline_can_still_be_retried(database_url: str) -> None:
    FLAKY["broken"] = True
    async with open_engine(database_url, Registry(chore)) as engine:
        iid = await engine.client.start(chore, {})
        await engine.run_until_idle()
        assert (await engine.client.get(iid)).status == "FAILED"
        await engine.advance(minutes=30)  # the operator comes back after the deadline
        assert (await engine.client.get(iid)).status == "FAILED"  # it was TIMED_OUT, which no retry takes
        passed = [h for h in await engine.client.history(iid) if h["kind"] == "DEADLINE_PASSED"]
        assert [h["data"]["outcome"] for h in passed] == ["left FAILED for an operator"]
        FLAKY["broken"] = False
        await engine.client.retry(iid)
        await engine.run_until_idle()
        info = await engine.client.get(iid)
        assert (info.status, info.state) == ("COMPLETED", {"done": True})


# -- an operator's retry and the deadlines ---------------------------------------------------------------

HANG: dict[str, asyncio.Event] = {}
"""While set here, `bounded` waits for the event (a handler that hangs), else it completes."""
HUNG: dict[str, asyncio.Event] = {}
"""Set by `bounded` when its handler starts to hang (so a test knows which worker holds it)."""

bounded: Workflow[Job] = Workflow("bounded", version=1, state=Job)


@bounded.step(start=True, next=None, retry=Retry(max_attempts=1), deadline=timedelta(minutes=5))
async def slow(ctx: StepContext, state: Job) -> None:
    if FLAKY["broken"]:
        raise RuntimeError("the service is down")
    if (hang := HANG.get("slow")) is not None:
        if (started := HUNG.get("slow")) is not None:
            started.set()
        await hang.wait()
    state.done = True


two_steps: Workflow[Job] = Workflow("two_steps", version=1, state=Job, deadline=timedelta(minutes=10))


@two_steps.step(start=True, next="after", retry=Retry(max_attempts=1))
def first(ctx: StepContext, state: Job) -> None:
    if FLAKY["broken"]:
        raise RuntimeError("the service is down")


@two_steps.step(next=None)
def after(ctx: StepContext, state: Job) -> None:
    state.done = True


async def test_an_operators_retry_bounds_the_step_by_its_deadline_again(database_url: str) -> None:
    # The step failed, its deadline passed while it waited for the operator; the retried step hangs. It is
    # bounded again, counted from the retry: it fails StepDeadline five minutes later (it hung for good).
    FLAKY["broken"] = True
    HANG["slow"] = asyncio.Event()
    HUNG["slow"] = asyncio.Event()
    async with open_engine(database_url, Registry(bounded), lease_seconds=3600) as engine:
        try:
            iid = await engine.client.start(bounded, {})
            await engine.run_until_idle()
            assert (await engine.client.get(iid)).status == "FAILED"
            await engine.advance(minutes=30)
            FLAKY["broken"] = False
            await engine.client.retry(iid)
            hung = asyncio.create_task(engine.run_until_idle())
            # The engine's worker must hold the hanging step before the other worker looks: else the other
            # could claim the retried step first and hang in its handler itself.
            await asyncio.wait_for(HUNG["slow"].wait(), 60)
            await engine.move_clock(timedelta(minutes=4))
            other = engine.new_worker(lease_seconds=3600, worker_id="other")
            await other.run_until_idle()
            assert (await engine.client.get(iid)).status == "RUNNING"  # not yet: counted from the retry
            await engine.move_clock(timedelta(minutes=2))
            await other.run_until_idle()
            info = await engine.client.get(iid)
            assert info.status == "FAILED" and info.error is not None and info.error["type"] == "StepDeadline", info
            history = [h["kind"] for h in await engine.client.history(iid)]
            assert history[history.index("INSTANCE_RETRIED"):].count("STEP_DEADLINE_EXCEEDED") == 1
        finally:
            HANG.pop("slow").set()
            HUNG.pop("slow", None)
            await asyncio.wait_for(hung, 10)  # its commit is refused: the deadline took its lease


async def test_a_retry_after_the_deadline_passed_runs_without_it_before_its_timer_fired(database_url: str) -> None:
    # The deadline passed while the instance was FAILED, and no worker had fired its timer yet when the
    # operator retried: the retry runs without that deadline, as it does when the timer fired first.
    FLAKY["broken"] = True
    async with open_engine(database_url, Registry(two_steps)) as engine:
        iid = await engine.client.start(two_steps, {})
        await engine.run_until_idle()
        assert (await engine.client.get(iid)).status == "FAILED"
        await engine.move_clock(timedelta(minutes=30))  # nothing runs: the deadline's timer is due, unclaimed
        FLAKY["broken"] = False
        await engine.client.retry(iid)
        await engine.run_until_idle()
        info = await engine.client.get(iid)
        assert (info.status, info.state) == ("COMPLETED", {"done": True}), info
        history = await engine.client.history(iid)
        kinds = [h["kind"] for h in history]
        assert kinds.index("DEADLINE_PASSED") < kinds.index("INSTANCE_RETRIED")
        [passed] = [h for h in history if h["kind"] == "DEADLINE_PASSED"]
        assert passed["data"]["outcome"] == "left FAILED for an operator"


async def test_a_retry_in_a_scope_running_the_default_registration_bounds_the_step_again(
    database_url: str, conn: asyncpg.Connection
) -> None:
    # A scope with no registration of its own runs the default scope's (definition_scope 'default'). The retry
    # looked the step deadlines up in the instance's own scope, found no row there and queued no timer: the
    # retried step ran unbounded.
    FLAKY["broken"] = True
    async with open_engine(database_url, Registry(bounded)) as engine:
        iid = await engine.client.start(bounded, {}, scope="tenant-a")
        await engine.run_until_idle()
        assert (await engine.client.get(iid)).status == "FAILED"
        assert await conn.fetchval("SELECT definition_scope FROM stepstone.instances WHERE id = $1", iid) == "default"
        await engine.client.retry(iid)
        timers = await conn.fetch(
            "SELECT c.step, c.available_at - c.created_at AS bound FROM stepstone.commands c WHERE c.instance_id = $1"
            " AND c.kind = 'TIMER' AND c.name = 'step_deadline' AND c.state = 'PENDING'", iid)
        assert [(t["step"], t["bound"]) for t in timers] == [("slow", timedelta(minutes=5))]
