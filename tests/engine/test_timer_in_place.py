"""A step that ends in a timed wait turns its claimed command into the wait's timer (migration 0035), on
PostgreSQL: a waiting instance keeps one command row; the timer fires and the run goes on; a signal that
ends the wait first still closes it and stays its own record; and a timer that follows what arrived from
outside (a signal) gets a row of its own, since that command is the record of the arrival."""

from __future__ import annotations

import json
from datetime import timedelta

from pydantic import BaseModel, Field

from stepstone import Registry, StepContext, Workflow
from stepstone.testing import open_engine
from tests.engine import workflows
from tests.engine.conftest import Rows


class Log(BaseModel):
    log: list[str] = Field(default_factory=list)


asking: Workflow[Log] = Workflow("in_place_ask", version=1, state=Log)


@asking.step(start=True, next="answer")
def ask(_ctx: StepContext, state: Log) -> None:
    state.log.append("ask")


asking.wait("answer", signals={"yes": "agreed"}, timeout=timedelta(seconds=60), on_timeout="gave_up")


@asking.step(next=None)
def agreed(_ctx: StepContext, state: Log) -> None:
    state.log.append("agreed")


@asking.step(next=None)
def gave_up(_ctx: StepContext, state: Log) -> None:
    state.log.append("gave_up")


told: Workflow[Log] = Workflow("in_place_told", version=1, state=Log)
told.wait("parked", signals={"go": "rest"}, start=True)
told.timer("rest", delay=timedelta(seconds=30), next="end")


@told.step(next=None)
def end(_ctx: StepContext, state: Log) -> None:
    state.log.append("end")


registry = Registry(workflows.timed, asking, told)  # timed: a step, a timer of 5 minutes, a step


async def test_a_step_that_ends_in_a_timed_wait_turns_its_command_into_the_timer(
    database_url: str, rows: Rows
) -> None:
    async with open_engine(database_url, registry) as engine:
        iid = await engine.client.start(workflows.timed, {"order_id": "o-1"})
        await engine.run_until_idle()
        [timer] = await rows.commands(iid)  # the START, become the timer: no settled row beside it
        assert (timer["kind"], timer["state"], timer["name"], timer["step"]) == ("TIMER", "PENDING", "fire", "nap")
        assert timer["seq"] > 1  # a fresh seq: behind anything queued while the step ran
        assert (timer["attempt"], timer["claims"], timer["deferrals"]) == (1, 0, 0)
        assert timer["claimed_by"] is None and timer["settled_at"] is None and timer["dedup_key"] is None
        # The claim's token stays: a worker whose commit outcome was lost reads that its claim settled.
        assert timer["token"] is not None
        assert await engine.store.settled_by(timer["id"], timer["token"])
        step_done = await rows.conn.fetchval(
            "SELECT command_id FROM stepstone.history WHERE instance_id = $1::uuid AND kind = 'STEP_COMPLETED'", iid)
        assert step_done == timer["id"]

        await engine.move_clock(301)
        await engine.run_until_idle()
        info = await engine.client.get(iid)
        assert (info.status, info.state["log"]) == ("COMPLETED", ["before", "after"])


async def test_a_signal_that_ends_the_wait_closes_the_timer_and_stays_its_own_record(
    database_url: str, rows: Rows
) -> None:
    async with open_engine(database_url, registry) as engine:
        iid = await engine.client.start(asking, {})
        await engine.run_until_idle()
        [timer] = await rows.commands(iid)
        assert (timer["kind"], timer["state"], timer["name"]) == ("TIMER", "PENDING", "timeout")

        await engine.client.signal(iid, "yes", {"by": "lee"})
        await engine.run_until_idle()
        assert (await engine.client.get(iid)).state["log"] == ["ask", "agreed"]
        found = [(c["kind"], c["state"]) for c in await rows.commands(iid)]
        assert ("TIMER", "SUPERSEDED") in found  # the wait's timeout, closed when the signal ended it
        [signal] = [c for c in await rows.commands(iid) if c["kind"] == "SIGNAL"]
        assert (signal["state"], json.loads(signal["payload"])) == ("COMPLETE", {"by": "lee"})

        await engine.move_clock(61)  # the closed timer never fires
        await engine.run_until_idle()
        assert (await engine.client.get(iid)).state["log"] == ["ask", "agreed"]


async def test_the_timeout_fires_from_the_row_that_ran_the_step(database_url: str, rows: Rows) -> None:
    async with open_engine(database_url, registry) as engine:
        iid = await engine.client.start(asking, {})
        await engine.run_until_idle()
        await engine.move_clock(61)
        await engine.run_until_idle()
        info = await engine.client.get(iid)
        assert (info.status, info.state["log"]) == ("COMPLETED", ["ask", "gave_up"])


async def test_a_timer_after_a_signal_gets_a_row_of_its_own(database_url: str, rows: Rows) -> None:
    async with open_engine(database_url, registry) as engine:
        iid = await engine.client.start(told, {})
        await engine.run_until_idle()
        await engine.client.signal(iid, "go", {})
        await engine.run_until_idle()
        found = [(c["kind"], c["state"]) for c in await rows.commands(iid)]
        assert found == [("START", "COMPLETE"), ("SIGNAL", "COMPLETE"), ("TIMER", "PENDING")]

        await engine.move_clock(31)
        await engine.run_until_idle()
        assert (await engine.client.get(iid)).state["log"] == ["end"]
