"""In-flight migration of an instance waiting on a timer, an external task or a child, with a step map that
renames the waited step: it goes on on the target, or is refused with nothing changed, never left stuck."""

from __future__ import annotations

from typing import Any

import pytest

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.errors import MigrationRefused
from stepstone.external import ExternalTasks
from stepstone.ops import migration
from stepstone.testing import Engine, open_engine

nap_v1: Workflow[Any] = Workflow("mw_nap", version=1)
nap_v1.timer("nap", delay=60, next="done", start=True)
nap_v2: Workflow[Any] = Workflow("mw_nap", version=2)
nap_v2.timer("sleep", delay=60, next="done", start=True)

call_v1: Workflow[Any] = Workflow("mw_call", version=1)
call_v1.external("call", topic="labels", next="done", start=True)
call_v2: Workflow[Any] = Workflow("mw_call", version=2)
call_v2.external("call2", topic="labels", next="done", start=True)

late_v1: Workflow[Any] = Workflow("mw_late", version=1)
late_v1.wait("hold", signals={"go": "done"}, deadline=30, on_deadline="done", start=True)
late_v2: Workflow[Any] = Workflow("mw_late", version=2)
late_v2.wait("hold", signals={"go": "done"}, start=True)
late_v3: Workflow[Any] = Workflow("mw_late", version=3)
late_v3.wait("wait", signals={"go": "done"}, deadline=30, on_deadline="done", start=True)

kid: Workflow[Any] = Workflow("mw_kid", version=1)
kid.wait("hold", signals={"go": "$end"}, start=True)
parent_v1: Workflow[Any] = Workflow("mw_parent", version=1)
parent_v2: Workflow[Any] = Workflow("mw_parent", version=2)


def _done(wf: Workflow[Any]) -> None:
    @wf.step(name="done")
    async def done(_ctx: StepContext, state: dict[str, Any]) -> None:
        state["ran"] = f"v{wf.version}"


for _wf in (nap_v1, nap_v2, call_v1, call_v2, late_v1, late_v2, late_v3, parent_v1, parent_v2):
    _done(_wf)


@parent_v1.child(name="spawn", workflow="mw_kid", next="done", start=True)
async def spawn(_ctx: StepContext, _state: dict[str, Any]) -> dict[str, Any]:
    return {}


@parent_v2.child(name="spawn2", workflow="mw_kid", next="done", start=True)
async def spawn2(_ctx: StepContext, _state: dict[str, Any]) -> dict[str, Any]:
    return {}


@pytest.fixture
async def engine(database_url: str) -> Any:
    async with open_engine(database_url, Registry(nap_v1, nap_v2, call_v1, call_v2, late_v1, late_v2, late_v3, kid,
                                                 parent_v1, parent_v2)) as e:
        yield e


async def test_a_renamed_timer_fires_on_the_target(engine: Engine) -> None:
    iid = await engine.client.start(nap_v1, {})
    await engine.run_until_idle()
    report = await engine.client.migrate(iid, to=nap_v2, step_map={"nap": "sleep"})
    assert report.counts == {"migrated": 1}
    await engine.advance(seconds=61)
    info = await engine.client.get(iid)
    assert (info.status, info.state) == ("COMPLETED", {"ran": "v2"})


async def test_a_renamed_child_step_takes_its_childs_end_on_the_target(engine: Engine) -> None:
    iid = await engine.client.start(parent_v1, {})
    await engine.run_until_idle()
    report = await engine.client.migrate(iid, to=parent_v2, step_map={"spawn": "spawn2"})
    assert report.counts == {"migrated": 1}
    [child] = (await engine.client.get(iid)).children
    await engine.client.signal(child["id"], "go")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.state) == ("COMPLETED", {"ran": "v2"})


async def test_an_external_step_waiting_for_its_task_keeps_its_name(engine: Engine) -> None:
    """The open external task names its step, and a fetch hands out only a task its position still waits
    for at that step: renamed, the task was closed as not awaited at the next fetch and the instance waited
    for it for ever. Such a migration is refused with nothing changed, as for a human task."""
    iid = await engine.client.start(call_v1, {})
    await engine.run_until_idle()
    with pytest.raises(MigrationRefused, match=r"external step 'call' is waiting for its task: it keeps its name "
                                               r"\('call2' given\)"):
        await engine.client.migrate(iid, to=call_v2, step_map={"call": "call2"})
    info = await engine.client.get(iid)
    assert (info.version, info.step, info.status) == (1, "call", "WAITING")
    tasks = ExternalTasks(engine.store, poll_interval=0.05)
    [task] = await tasks.fetch_and_lock("w", ["labels"])
    await tasks.complete(task.id, task.lock_token, {"label": "L-1"}, worker_id="w")
    await engine.run_until_idle()
    done = await engine.client.get(iid)
    assert (done.status, done.state) == ("COMPLETED", {"label": "L-1", "ran": "v1"})


async def test_a_step_whose_deadline_runs_keeps_it_and_its_name(engine: Engine) -> None:
    """A step deadline runs on a timer scheduled on entering the step, which names the step: moved to a v2
    whose step declares no deadline, the timer fired anyway and its command crashed the segment (TypeError
    formatting the missing deadline), claimed again and again on its way to a dead letter; renamed, the
    timer named a step no position was at and the deadline silently never applied. Both are refused,
    as a wait's timeout is, with nothing changed; the instance then runs on v1."""
    iid = await engine.client.start(late_v1, {})
    await engine.run_until_idle()
    with pytest.raises(MigrationRefused, match=r"step 'hold' and 'hold' in v2 differ in having a step deadline"):
        await engine.client.migrate(iid, to=late_v2)
    with pytest.raises(MigrationRefused, match=r"step 'hold' has a step deadline running: it keeps its name "
                                               r"\('wait' given\)"):
        await engine.client.migrate(iid, to=late_v3, step_map={"hold": "wait"})
    await engine.advance(seconds=60)
    info = await engine.client.get(iid)
    assert (info.version, info.status, info.state) == (1, "COMPLETED", {"ran": "v1"})


@pytest.mark.parametrize(("target", "step_map", "why"), [
    (late_v2, {}, "v2 has no step deadline"),
    (late_v3, {"hold": "wait"}, "v3 has no such step"),
])
async def test_a_deadline_timer_its_plan_no_longer_backs_is_moot(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, target: Workflow[Any], step_map: dict[str, str], why: str,
) -> None:
    """An instance a release before the check above moved anyway: its deadline's timer, naming v1's step,
    fired on the target's plan and crashed the segment (TypeError formatting the missing deadline), again
    at every claim; renamed, it interrupted nothing, silently. Now it is moot, said in history, and the
    wait goes on under the target."""
    iid = await engine.client.start(late_v1, {})
    await engine.run_until_idle()
    monkeypatch.setattr(migration, "_check_deadline", lambda *_args: None)  # as that release migrated
    assert (await engine.client.migrate(iid, to=target, step_map=step_map)).counts == {"migrated": 1}
    await engine.advance(seconds=60)
    info = await engine.client.get(iid)
    assert (info.version, info.status, info.error) == (target.version, "WAITING", None)
    [moot] = [h for h in await engine.client.history(iid) if h["kind"] == "STEP_DEADLINE_MOOT"]
    assert (moot["step"], moot["data"]["reason"]) == ("hold", why)
    await engine.client.signal(iid, "go")
    await engine.run_until_idle()
    done = await engine.client.get(iid)
    assert (done.status, done.state) == ("COMPLETED", {"ran": f"v{target.version}"})
