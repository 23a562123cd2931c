"""An instance deadline and a FAILED instance: the deadline bounds running, not an operator's repair."""

from __future__ import annotations

from datetime import timedelta

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
