"""In-flight migration of instances with live parallel branches, and its place in the command order."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import uuid
from typing import Any

import pytest
from click.testing import CliRunner
from pydantic import BaseModel

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.cli import cli
from stepstone.core.effects import RecordHistory
from stepstone.core.model import Decision, Settle
from stepstone.core.pin import Pin, pin_of
from stepstone.errors import PositionNotFound, WaitTimeout
from stepstone.ops.migration import migrate_one
from stepstone.store.port import CommitRequest
from stepstone.testing import Engine, open_engine


class Ran(BaseModel):
    ran: str = ""


# v1: a fork whose two branches each wait for "go"; v2 renames every step but the fork and adds a
# wait after the join ("hold"), which accepts "go" too but lies outside the branches.
p1: Workflow[Ran] = Workflow("mig_par", version=1, state=Ran)
p1.fork("split", branches={"left": "lw", "right": "rw"}, start=True)
p1.wait("lw", signals={"go": "ldone"})
p1.wait("rw", signals={"go": "rdone"})
p1.join("merge", fork="split", next="fin")


@p1.step(next="merge")
async def ldone(_ctx: StepContext, state: Ran) -> None:
    state.ran += "L1"


@p1.step(next="merge")
async def rdone(_ctx: StepContext, state: Ran) -> None:
    state.ran += "R1"


@p1.step
async def fin(_ctx: StepContext, state: Ran) -> None:
    state.ran += "/v1"


p2: Workflow[Ran] = Workflow("mig_par", version=2, state=Ran)
p2.fork("split", branches={"left": "lw2", "right": "rw2"}, start=True)
p2.wait("lw2", signals={"go": "ldone2", "skip": "ldone2"})
p2.wait("rw2", signals={"go": "rdone2"})
p2.join("merge2", fork="split", next="hold")
p2.wait("hold", signals={"go": "fin2"})


@p2.step(name="ldone2", next="merge2")
async def ldone_v2(_ctx: StepContext, state: Ran) -> None:
    state.ran += "L2"


@p2.step(name="rdone2", next="merge2")
async def rdone_v2(_ctx: StepContext, state: Ran) -> None:
    state.ran += "R2"


@p2.step(name="fin2")
async def fin_v2(_ctx: StepContext, state: Ran) -> None:
    state.ran += "/v2"


PAR_MAP = {"lw": "lw2", "rw": "rw2", "ldone": "ldone2", "rdone": "rdone2", "merge": "merge2", "fin": "fin2"}

# Two waits in a row: a signal queued before a migration moves the instance on v1 first.
o1: Workflow[Ran] = Workflow("mig_order", version=1, state=Ran)
o1.wait("first", signals={"go": "second"}, start=True)
o1.wait("second", signals={"go": "done"})


@o1.step
async def done(_ctx: StepContext, state: Ran) -> None:
    state.ran = "v1"


o2: Workflow[Ran] = Workflow("mig_order", version=2, state=Ran)
o2.wait("first", signals={"go": "second2"}, start=True)
o2.wait("second2", signals={"go": "done2"})


@o2.step(name="done2")
async def done_v2(_ctx: StepContext, state: Ran) -> None:
    state.ran = "v2"


ORDER_MAP = {"second": "second2", "done": "done2"}


registry = Registry(p1, p2, o1, o2)


@pytest.fixture
async def engine(database_url: str) -> Any:
    async with open_engine(database_url, registry) as e:
        yield e


async def _positions(engine: Engine, iid: str) -> dict[str, tuple[str, str]]:
    pool = engine.store.pool  # type: ignore[attr-defined]
    rows = await pool.fetch("SELECT path, step, status FROM stepstone.positions WHERE instance_id = $1",
                            uuid.UUID(iid))
    return {r["path"]: (r["step"], r["status"]) for r in rows}


async def _signal_waiting(engine: Engine, iid: str) -> None:
    """Send "go" to every position that waits for a signal, then run what that made claimable."""
    for path, (_step, status) in (await _positions(engine, iid)).items():
        if status == "WAITING" and path != "":
            await engine.client.signal(iid, "go", position=path)
    info = await engine.client.get(iid)
    if info.status == "WAITING" and info.waiting_for and info.waiting_for.get("kind") == "signal":
        await engine.client.signal(iid, "go")
    await engine.run_until_idle()


async def _finish(engine: Engine, iid: str, rounds: int = 4) -> Any:
    for _ in range(rounds):
        await _signal_waiting(engine, iid)
    return await engine.client.get(iid)


async def test_an_instance_with_live_branches_is_migrated_position_by_position(engine: Engine) -> None:
    iid = await engine.client.start(p1, {})
    await engine.run_until_idle()
    assert await _positions(engine, iid) == {
        "": ("split", "WAITING"), "split/left": ("lw", "WAITING"), "split/right": ("rw", "WAITING")}
    report = await engine.client.migrate(iid, to=p2, step_map=PAR_MAP)
    assert report.counts == {"migrated": 1}
    assert await _positions(engine, iid) == {
        "": ("split", "WAITING"), "split/left": ("lw2", "WAITING"), "split/right": ("rw2", "WAITING")}
    await engine.client.signal(iid, "skip", position="split/left")  # a signal only v2's branch accepts
    await engine.client.signal(iid, "go", position="split/right")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.version, info.step, info.status) == (2, "hold", "WAITING")
    done_info = await _finish(engine, iid)
    assert done_info.status == "COMPLETED"
    assert sorted(done_info.state["ran"].split("/")[0]) == sorted("L2R2") and done_info.state["ran"].endswith("/v2")


async def test_a_branch_that_already_reached_the_join_stays_done(engine: Engine) -> None:
    iid = await engine.client.start(p1, {})
    await engine.run_until_idle()
    await engine.client.signal(iid, "go", position="split/left")
    await engine.run_until_idle()  # left ran on v1 and reached the join; right still waits
    report = await engine.client.migrate(iid, to=p2, step_map=PAR_MAP)
    assert report.counts == {"migrated": 1}
    positions = await _positions(engine, iid)
    assert positions["split/left"][1] == "COMPLETED" and positions["split/right"] == ("rw2", "WAITING")
    info = await _finish(engine, iid)
    assert (info.status, info.version) == ("COMPLETED", 2)
    assert info.state["ran"] == "L1R2/v2"  # left ran on v1 before the migration, right on v2


async def test_a_branch_mapped_outside_its_fork_is_refused_and_nothing_changes(engine: Engine) -> None:
    iid = await engine.client.start(p1, {})
    await engine.run_until_idle()
    before = await _positions(engine, iid)
    history = await engine.client.history(iid)
    report = await engine.client.migrate([iid], to=p2, step_map={**PAR_MAP, "lw": "hold"})
    assert report.counts == {"refused": 1}
    assert "never reaches the join 'merge2' of fork 'split'" in report.outcomes[0].reason
    assert await _positions(engine, iid) == before
    assert await engine.client.history(iid) == history


async def test_random_step_maps_never_leave_an_unreachable_state(engine: Engine) -> None:
    """Property: whatever step map is given, an accepted migration leaves every live position on a
    step of the same kind from which the instance can finish, and a refused one changes nothing; every
    instance completes either way."""
    rng = random.Random(20261201)  # noqa: S311 - seeded, so a failing map is reproducible
    names = [*p2.plan.steps, "nowhere"]
    for _ in range(10):
        step_map = {s: rng.choice([*names, s]) for s in p1.plan.steps if rng.random() < 0.8}
        iid = await engine.client.start(p1, {})
        await engine.run_until_idle()
        if rng.random() < 0.5:
            await engine.client.signal(iid, "go", position="split/left")
            await engine.run_until_idle()
        before = await _positions(engine, iid)
        report = await engine.client.migrate([iid], to=p2, step_map=step_map)
        outcome = report.outcomes[0].outcome
        assert outcome in ("migrated", "refused"), report
        after = await _positions(engine, iid)
        if outcome == "refused":
            assert after == before, (step_map, report)
        else:
            for path, (step, status) in after.items():
                if status in ("RUNNING", "WAITING"):
                    assert p2.plan.steps[step].kind == p1.plan.steps[before[path][0]].kind, (step_map, path)
        info = await _finish(engine, iid)
        assert info.status == "COMPLETED", (step_map, report, await _positions(engine, iid))
        assert info.version == (2 if outcome == "migrated" else 1)


async def test_a_migration_waits_behind_a_signal_queued_before_it(engine: Engine) -> None:
    iid = await engine.client.start(o1, {})
    await engine.run_until_idle()
    await engine.store.definitions.heartbeat("a-v1-worker", [pin_of(o1)])  # v1 is served: the signal can run
    signal_id = await engine.client.signal(iid, "go")  # queued, not applied: no worker has run yet
    refused = await engine.client.migrate([iid], to=o2, step_map=ORDER_MAP, patience=0)
    assert refused.counts == {"refused": 1} and "queued before the migration" in refused.outcomes[0].reason
    assert ((await engine.client.get(iid)).version, (await engine.client.get(iid)).step) == (1, "first")

    migrating = asyncio.create_task(migrate_one(engine.store.definitions, iid, to=o2, step_map=ORDER_MAP,
                                                state_transform=None))
    await engine.run_until_idle()  # the signal is applied on v1 first: first -> second
    outcome = await migrating
    assert outcome.outcome == "migrated", outcome
    info = await engine.client.get(iid)
    assert (info.version, info.step) == (2, "second2")
    kinds = [h["kind"] for h in await engine.client.history(iid)]
    assert kinds.index("SIGNAL_APPLIED") < kinds.index("INSTANCE_MIGRATED"), kinds
    pool = engine.store.pool  # type: ignore[attr-defined]
    seqs = {r["kind"]: r["seq"] for r in await pool.fetch(
        "SELECT kind, seq FROM stepstone.commands WHERE instance_id = $1", uuid.UUID(iid))}
    signal_seq = await pool.fetchval("SELECT seq FROM stepstone.commands WHERE id = $1", signal_id)
    assert signal_seq < seqs["MIGRATION"]
    await engine.client.signal(iid, "go")
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).state == {"ran": "v2"}


async def test_the_cli_migration_waits_as_long_as_its_patience(engine: Engine, database_url: str) -> None:
    iid = await engine.client.start(o1, {})
    await engine.run_until_idle()
    await engine.store.definitions.heartbeat("a-v1-worker", [pin_of(o1)])
    await engine.client.signal(iid, "go")  # queued before the migration, and a worker could run it
    args = ["definitions", "migrate", iid, "--app", "tests.registry.test_migration_branches:registry",
            "--workflow", "mig_order", "--to-version", "2", "--step-map", "second=second2",
            "--step-map", "done=done2", "--patience", "0.5", "-o", "json", "--database-url", database_url]
    result = await asyncio.to_thread(CliRunner().invoke, cli, args)
    assert result.exit_code == 4, result.output  # one was refused
    report = json.loads(result.stdout)
    assert report["counts"] == {"refused": 1}, report
    # The answer names the patience it was given (the default would have waited 30 s).
    assert "queued before the migration were not applied within 0.5 s" in report["instances"][0]["reason"]
    assert (await engine.client.get(iid)).version == 1


async def test_commands_no_live_worker_can_run_do_not_hold_a_migration_back(engine: Engine) -> None:
    """No worker serves v1 (the instance is stranded): its queued signal cannot run before the
    migration, so the migration goes first and the signal then runs on v2."""
    iid = await engine.client.start(o1, {})
    await engine.run_until_idle()
    await engine.client.signal(iid, "go")
    outcome = await migrate_one(engine.store.definitions, iid, to=o2, step_map=ORDER_MAP, state_transform=None,
                                patience=0)
    assert outcome.outcome == "migrated", outcome
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.version, info.step) == (2, "second2")  # first -> second2: v2's route for "go"


async def test_a_signal_sent_after_the_migration_is_planned_does_not_hold_it_back(engine: Engine) -> None:
    iid = await engine.client.start(o1, {})
    await engine.run_until_idle()
    order_seq = await engine.store.definitions.reserve_command_seq()  # the migration's place, taken first
    await engine.client.signal(iid, "go")  # queued behind the migration
    view = await engine.store.definitions.migration_view(iid)
    to_wait = {"kind": "signal", "signals": {"go": "second2"}, "timeout_seconds": None}  # v2's wait "first"
    positions = [{**{k: p[k] for k in ("path", "step", "visit", "status")}, "to_step": "first", "to_wait": to_wait}
                 for p in view["positions"]]
    outcome, _ = await engine.store.definitions.migrate_instance(
        iid, order_seq=order_seq, from_pin=_pin(view), state_version=int(view["state_version"]),
        to_pin=_pin({**view, "version": 2, "plan_hash": o2.plan.plan_hash}), step_map={}, positions=positions,
        state=view["state"], actor=None)
    assert outcome == "migrated"
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.version, info.step) == (2, "second2")  # the later signal ran on v2


async def _ended_or_shown(engine: Engine, iid: str) -> Any:
    """The instance once it ends; if it does not within 60 s, a failure that shows its positions,
    commands and history (this test failed once in CI, under load, with an instance left WAITING)."""
    try:
        return await engine.client.wait_for(iid, timeout=60)
    except WaitTimeout:
        pool = engine.store.pool  # type: ignore[attr-defined]
        rows = await pool.fetch(
            "SELECT 'position' AS what, path AS a, step AS b, status AS c, visit::text AS d "
            "FROM stepstone.positions WHERE instance_id = $1 UNION ALL "
            "SELECT 'command', position, kind || ' ' || coalesce(name, ''), state, coalesce(last_error, '') "
            "FROM stepstone.commands WHERE instance_id = $1", uuid.UUID(iid))
        kinds = [(h["kind"], h.get("position"), h.get("step")) for h in await engine.client.history(iid)]
        pytest.fail(f"{iid} did not end: {[tuple(r) for r in rows]}; history {kinds}")


def _pin(view: dict[str, Any]) -> Pin:
    return Pin(view["definition_scope"], view["definition_id"], int(view["version"]), view["plan_hash"])


async def test_migrating_branching_instances_under_load_loses_nothing_and_migrates_nothing_twice(
    database_url: str,
) -> None:
    """Two batch migrations race each other and the signals to the branches while a worker runs:
    every instance completes, each is migrated at most once, and what ran matches where it ended."""
    async with open_engine(database_url, Registry(p1, p2), concurrency=4, poll_interval=0.05) as engine:
        ids = [await engine.client.start(p1, {}) for _ in range(10)]
        for iid in ids:  # the root's "go" waits (parked) until a wait takes it: v2's hold, never v1's
            await engine.client.signal(iid, "go")
        worker = engine.new_worker(concurrency=4, poll_interval=0.05, heartbeat_seconds=0.2)
        await worker.start()
        try:
            async def signal_branches(some: list[str]) -> None:
                for iid in some:
                    for branch in ("split/left", "split/right"):
                        with contextlib.suppress(PositionNotFound):  # not opened yet: sent again below
                            await engine.client.signal(iid, "go", position=branch, dedup_key=f"{iid}/{branch}")

            async def migrate_all() -> Any:
                return await engine.client.migrate(to=p2, definition="mig_par", from_version=1, step_map=PAR_MAP)

            # half the instances get their branch signals during the migrations, the others after them
            _, first, second = await asyncio.gather(signal_branches(ids[::2]), migrate_all(), migrate_all())
            await signal_branches(ids)  # a repeat is one signal per branch (its dedup key)
            infos = [await _ended_or_shown(engine, iid) for iid in ids]
        finally:
            await worker.stop()
        # Seen once (a full local run with a benchmark loading the server): an instance FAILED. Its error
        # and history go into the failure, so that the next occurrence says why.
        ended = {i.id: (i.status, i.error) for i in infos if i.status != "COMPLETED"}
        shown = {iid: [(h["kind"], h.get("position"), h.get("step"), h.get("data")) for h in
                       await engine.client.history(iid)] for iid in ended}
        assert ended == {}, f"did not complete: {ended}; history {shown}"
        migrated = 0
        for iid, info in zip(ids, infos, strict=True):
            entries = [h for h in await engine.client.history(iid) if h["kind"] == "INSTANCE_MIGRATED"]
            assert len(entries) <= 1
            migrated += len(entries)
            assert info.version == (2 if entries else 1)
            assert info.state["ran"].endswith("/v2" if entries else "/v1")
        assert first.counts.get("migrated", 0) + second.counts.get("migrated", 0) == migrated >= len(ids) // 2
        assert "refused" not in first.counts and "refused" not in second.counts, (first.outcomes, second.outcomes)


async def test_a_branch_that_reported_while_the_migration_was_planned_is_not_forgotten(engine: Engine) -> None:
    """The interleaving CI once hit under load: the migration reads the instance while the right branch's
    position has completed but its report (BRANCH_DONE) is not yet applied to the fork's position; the
    report then lands, which changes the fork's join counts but nothing the fence compares. The join must
    still count that branch: without it the instance waited forever at the fork."""
    iid = await engine.client.start(p1, {})
    await engine.run_until_idle()
    definitions = engine.store.definitions
    read = definitions.migration_view
    earlier = await read(iid)  # the fork's wait before any branch reported
    await engine.client.signal(iid, "go", position="split/right")
    await engine.run_until_idle()

    async def read_mid_report(instance_id: str) -> dict[str, Any]:
        view = await read(instance_id)  # the right branch's position COMPLETED, the state as it is now
        stale_root = next(p for p in earlier["positions"] if p["path"] == "")
        return {**view, "positions": [{**p, "wait": stale_root["wait"]} if p["path"] == "" else p
                                      for p in view["positions"]]}

    definitions.migration_view = read_mid_report  # type: ignore[method-assign]
    outcome = await migrate_one(definitions, iid, to=p2, step_map=PAR_MAP, state_transform=None, patience=0)
    definitions.migration_view = read  # type: ignore[method-assign]
    assert outcome.outcome == "migrated", outcome
    await engine.client.signal(iid, "go", position="split/left")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.version, info.step, info.status) == (2, "hold", "WAITING")  # the join fired: both counted


async def test_a_segment_that_ran_the_version_it_was_migrated_from_commits_nothing(engine: Engine) -> None:
    """A claim whose statement runs while a migration commits locks the position as the migration left it
    but reads the instance row of its snapshot, old version included, and its worker runs that version's
    step (seen once under load in the test above: an instance migrated to v2 whose last step ran v1's).
    The commit compares the version the segment ran with the instance's (migration 0038): nothing of the
    segment is written, and its command is claimable at once, under the new version."""
    iid = await engine.client.start(o1, {})
    await engine.run_until_idle()  # waits at "first"
    await engine.client.signal(iid, "go")
    [claim] = await engine.store.claim(1, 30, "old-reader")
    assert claim.pin.version == 1
    pool = engine.store.pool  # type: ignore[attr-defined]
    # What such a migration committed beside the claim (a migration that starts after the claim waits:
    # the claim holds the position's lease).
    await pool.execute("UPDATE stepstone.instances SET version = 2, plan_hash = $2, state_version = state_version + 1"
                       " WHERE id = $1", uuid.UUID(iid), pin_of(o2).plan_hash)
    ran_v1 = Decision(Settle("COMPLETE"), (RecordHistory("NOTED", "first", claim.instance.visit),))
    request = CommitRequest(claim, claim.command.id, ran_v1, claim.instance.visit, claim.instance.state_version)
    assert await engine.store.commit(request, lease_seconds=30, worker="old-reader") is None
    assert "NOTED" not in [h["kind"] for h in await engine.client.history(iid)]
    [again] = await engine.store.claim(1, 30, "new-reader")  # at once: no lease to wait out
    assert (again.command.id, again.pin.version, again.command.claims) == (claim.command.id, 2, 1)
