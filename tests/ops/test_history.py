"""History you can read: actors, commands, positions, outcomes, patches and baselines; the retry view."""

from __future__ import annotations

from datetime import timedelta

from stepstone.client import Client
from stepstone.core.attribution import Actor
from stepstone.core.baselines import PATCH_LIMIT
from stepstone.ops import Operations
from stepstone.ops.history import state_at
from stepstone.testing import Engine
from tests.ops import workflows


async def test_entries_name_actor_command_position_step_outcome_and_patch(engine: Engine, ops: Operations) -> None:
    client = Client(engine.store, workflows.registry, actor=Actor("alice", "user", reason="ticket 7"))
    try:
        iid = await client.start(workflows.flaky, {"name": "a"})
    finally:
        await client.detach()
    await engine.run_until_idle()
    page = await ops.history(iid)
    kinds = [e.kind for e in page.entries]
    assert kinds == ["INSTANCE_STARTED", "STEP_COMPLETED", "STEP_COMPLETED", "INSTANCE_COMPLETED"]
    started, work, done, _ = page.entries
    assert started.actor == Actor("alice", "user", reason="ticket 7")
    assert started.data["state"] == {"name": "a", "log": [], "results": {}, "counter": 0}
    # The worker decided, on behalf of whoever recorded the START.
    assert work.actor is not None and work.actor.kind == "worker"
    assert work.actor.id == engine.worker.config.worker_id
    assert Actor.parse(work.actor.on_behalf_of) == Actor("alice", "user", reason="ticket 7")
    assert work.command_id is not None and work.command_kind == "START"
    assert (work.position, work.step, work.outcome) == ("", "work", "completed")
    # Client.history says the same of the root: '' (it said None for every root entry).
    assert [(h["kind"], h["position"]) for h in await engine.client.history(iid)] == [
        (e.kind, e.position) for e in page.entries]
    assert work.patch == [{"op": "replace", "path": "/log", "value": ["work@1"]}]
    # The next step went on in the START's row (migration 0030): the same command, what began the run.
    assert done.command_id == work.command_id and done.command_kind == "START"
    assert done.actor is not None and done.actor.on_behalf_of is not None
    # Replaying the patches on the baseline gives the state the instance ended with.
    info = await engine.client.get(iid)
    assert state_at(page.entries, page.entries[-1].seq + 1) == info.state


async def test_a_step_whose_command_became_its_timer_still_names_that_command(
    engine: Engine, ops: Operations
) -> None:
    """The START row that ran `wake` becomes the timer `nap` in place (migration 0035); the entries written
    before read TIMER, a timer that had not been set yet. A retried instance's RETRY row does the same:
    those entries name no kind, since the row no longer says whether it was a STEP or a RETRY."""
    iid = await engine.client.start(workflows.napping, {})
    await engine.run_until_idle()
    await engine.advance(seconds=11)
    failed = await engine.client.start(workflows.napping, {})
    workflows.FAILURES[failed] = -1
    await engine.run_until_idle()
    workflows.FAILURES.pop(failed)
    assert (await ops.retry([failed])).succeeded == 1
    await engine.run_until_idle()
    await engine.advance(seconds=11)
    for instance, first in ((iid, "START"), (failed, None)):
        entries = [e for e in (await ops.history(instance)).entries if e.command_id is not None]
        ran = [(e.kind, e.step, e.command_kind) for e in entries if e.step in ("wake", "nap") or e.kind == "WAITING"]
        assert ran[-3:] == [("STEP_COMPLETED", "wake", first), ("WAITING", "nap", first),
                            ("TIMER_FIRED", "nap", "TIMER")], ran
        assert (await engine.client.get(instance)).status == "COMPLETED"


async def test_a_retry_in_backoff_is_visible(engine: Engine, ops: Operations) -> None:
    iid = await engine.client.start(workflows.flaky, {})
    workflows.FAILURES[iid] = 2
    await engine.run_until_idle()
    detail = await ops.detail(iid)
    assert len(detail.retrying) == 1
    retrying = detail.retrying[0]
    assert (retrying.step, retrying.attempt, retrying.max_attempts) == ("work", 2, 5)
    assert retrying.describe().startswith("retrying step work, attempt 2 of 5, next at ")
    assert "upstream busy (attempt 1)" in (retrying.last_error or "")
    failed = (await ops.history(iid, failed_only=True)).entries
    assert [(e.kind, e.outcome, e.data["max_attempts"]) for e in failed] == [("STEP_FAILED", "retrying", 5)]
    stuck = await ops.stuck(timedelta(hours=1))
    assert [(i.instance_id, i.reason) for i in stuck.items] == [(iid, "retrying")]
    await engine.move_clock(31)
    await engine.run_until_idle()
    assert (await ops.detail(iid)).retrying[0].attempt == 3
    await engine.move_clock(61)
    await engine.run_until_idle()
    assert (await ops.detail(iid)).retrying == []
    assert (await engine.client.get(iid)).status == "COMPLETED"


async def test_an_oversized_change_is_logged_as_a_baseline(engine: Engine, ops: Operations) -> None:
    big = "x" * (PATCH_LIMIT + 10)
    iid = await engine.client.start(workflows.flaky, {"name": big})
    await engine.run_until_idle()
    # The change itself is small; make a big one through the forky counter instead.
    entries = (await ops.history(iid)).entries
    assert all(e.kind != "STATE_BASELINE" for e in entries)  # a small patch stays a patch
    from stepstone.core.baselines import step_completed  # noqa: PLC0415 - the unit under test
    from stepstone.core.patch import diff  # noqa: PLC0415

    records = step_completed("s", 2, 1, diff({"a": 1}, {"a": big}), {"a": big})
    assert [r.kind for r in records] == ["STEP_COMPLETED", "STATE_BASELINE"]
    assert records[0].data["patch"] is None and records[1].data["state"] == {"a": big}


async def test_signals_and_retries_carry_their_actor(engine: Engine, ops: Operations) -> None:
    iid = await engine.client.start(workflows.flaky, {})
    await workflows.failed_for_good(engine, iid)
    assert (await engine.client.get(iid)).status == "FAILED"
    report = await ops.retry([iid])
    assert report.succeeded == 1
    await engine.run_until_idle()
    entries = (await ops.history(iid)).entries
    retried = next(e for e in entries if e.kind == "INSTANCE_RETRIED")
    assert retried.actor == Actor("oncall")
    after = [e for e in entries if e.seq > retried.seq and e.kind == "STEP_COMPLETED"]
    assert after and after[0].command_kind == "RETRY" and after[0].actor is not None
    assert after[0].actor.on_behalf_of == "oncall"
