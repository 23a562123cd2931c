"""In-flight migration: checked against the target before anything is written, applied once, recorded."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import pytest
from pydantic import BaseModel

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.errors import InstanceNotFound, InvalidState, MigrationRefused
from stepstone.ops import migration
from stepstone.testing import Engine, open_engine


class OrderV1(BaseModel):
    amount: int
    ran: str = ""


class OrderV2(BaseModel):
    amount: int
    currency: str
    ran: str = ""


v1: Workflow[OrderV1] = Workflow("mig", version=1, state=OrderV1)
v2: Workflow[OrderV2] = Workflow("mig", version=2, state=OrderV2)


@v1.step(start=True, next="w")
async def a(_ctx: StepContext, state: OrderV1) -> None:
    state.amount += 1


v1.wait("w", signals={"go": "b"}, timeout=3600, on_timeout="b")


@v1.step
async def b(_ctx: StepContext, state: OrderV1) -> None:
    state.ran = "v1"


@v2.step(name="a", start=True, next="w2")
async def a2(_ctx: StepContext, state: OrderV2) -> None:
    state.amount += 1


v2.wait("w2", signals={"go": "b2", "stop": "b2"}, timeout=600, on_timeout="b2")


@v2.step
async def b2(_ctx: StepContext, state: OrderV2) -> None:
    state.ran = "v2"


STEP_MAP = {"w": "w2", "b": "b2"}


def add_currency(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "currency": "EUR"}


@pytest.fixture
async def engine(database_url: str) -> Any:
    async with open_engine(database_url, Registry(v1, v2)) as e:
        yield e


async def _waiting(engine: Engine, n: int = 1) -> list[str]:
    ids = [await engine.client.start(v1, {"amount": i}) for i in range(n)]
    await engine.run_until_idle()
    return ids


async def _rows(engine: Engine, sql: str, iid: str) -> list[dict[str, Any]]:
    pool = engine.store.pool  # type: ignore[attr-defined]
    return [dict(r) for r in await pool.fetch(sql, uuid.UUID(iid))]


async def test_a_waiting_instance_moves_to_v2_and_finishes_there(engine: Engine) -> None:
    [iid] = await _waiting(engine)
    report = await engine.client.migrate(iid, to=v2, step_map=STEP_MAP, state_transform=add_currency)
    assert report.counts == {"migrated": 1}
    info = await engine.client.get(iid)
    assert (info.version, info.step, info.status) == (2, "w2", "WAITING")
    assert info.state == {"amount": 1, "currency": "EUR", "ran": ""}
    assert info.waiting_for["signals"] == {"go": "b2", "stop": "b2"}
    history = await engine.client.history(iid)
    assert history[-1]["kind"] == "INSTANCE_MIGRATED"
    assert history[-1]["data"]["state"] == info.state  # a full baseline
    assert (history[-1]["data"]["from_version"], history[-1]["data"]["to_version"]) == (1, 2)
    commands = await _rows(engine, "SELECT kind, state, step FROM stepstone.commands WHERE instance_id = $1 "
                                   "ORDER BY seq, id", iid)
    assert {"kind": "MIGRATION", "state": "COMPLETE", "step": None} in commands
    assert {"kind": "TIMER", "state": "PENDING", "step": "w2"} in commands  # its timeout moved with it
    await engine.client.signal(iid, "stop")  # a signal only v2 knows
    await engine.run_until_idle()
    done = await engine.client.get(iid)
    assert (done.status, done.state["ran"]) == ("COMPLETED", "v2")
    again = await engine.client.migrate(iid, to=v2, step_map=STEP_MAP, state_transform=add_currency)
    assert again.outcomes[0].outcome == "skipped"


async def test_an_instance_that_timed_out_is_left_as_it_ended(engine: Engine) -> None:
    """TIMED_OUT (like COMPENSATED) is an end: a migration skips it as it skips a COMPLETED or CANCELLED
    instance. Both the check before (ops.migration) and the statement (migrate_instance) knew only
    those two as ended."""
    iid = await engine.client.start(v1, {"amount": 1}, deadline=5)
    await engine.run_until_idle()
    await engine.advance(seconds=10)
    assert (await engine.client.get(iid)).status == "TIMED_OUT"
    history = await engine.client.history(iid)
    report = await engine.client.migrate(iid, to=v2, step_map=STEP_MAP, state_transform=add_currency)
    assert (report.outcomes[0].outcome, report.outcomes[0].reason) == ("skipped", "instance is TIMED_OUT")
    assert (await engine.client.get(iid)).version == 1
    assert await engine.client.history(iid) == history
    # The statement says so too, for an instance that ends between the check and the migration.
    [row] = await _rows(engine, "SELECT version, plan_hash, state_version FROM stepstone.instances WHERE id = $1", iid)
    answer = await engine.store.pool.fetchval(  # type: ignore[attr-defined]
        "SELECT outcome FROM stepstone.migrate_instance($1, $2, $3, $4, 2, $5, '{}'::jsonb, '[]'::jsonb, "
        "'{}'::jsonb, NULL)", uuid.UUID(iid), row["version"], row["plan_hash"], row["state_version"], "h2")
    assert answer == "ended"


@pytest.mark.parametrize(("step_map", "transform", "reason"), [
    ({}, add_currency, r"at step 'w': v2 has no step 'w'; map it with step_map to one of its steps \(a, w2, b2\)"),
    ({"w": "nope"}, add_currency, r"maps to 'nope' through step_map, but v2 has no such step \(its steps: a, w2, b2"),
    ({**STEP_MAP, "nothere": "b2"}, add_currency, r"step_map maps 'nothere', which v1 does not have \(its steps: a, w"),
    ({"w": "a"}, add_currency, "is a wait step, 'a' in v2 a action"),
    (STEP_MAP, None, "does not fit v2's state model"),
    (STEP_MAP, lambda _s: 1 / 0, "state_transform raised ZeroDivisionError"),
])
async def test_a_migration_that_cannot_fit_is_refused_and_changes_nothing(
    engine: Engine, step_map: dict[str, str], transform: Any, reason: str
) -> None:
    [iid] = await _waiting(engine)
    before = await engine.client.get(iid)
    history = await engine.client.history(iid)
    dry = await engine.client.migrate([iid], to=v2, step_map=step_map, state_transform=transform, dry_run=True)
    with pytest.raises(MigrationRefused, match=reason):  # the dry run says the same
        dry.raise_for_refusals()
    with pytest.raises(MigrationRefused, match=reason):
        await engine.client.migrate(iid, to=v2, step_map=step_map, state_transform=transform)
    after = await engine.client.get(iid)
    assert (after.version, after.step, after.state, after.waiting_for) == (1, "w", before.state, before.waiting_for)
    assert await engine.client.history(iid) == history


async def test_a_target_that_is_not_available_is_refused(engine: Engine) -> None:
    [iid] = await _waiting(engine)
    await engine.store.definitions.transition("default", "mig", 2, "DEPRECATED")
    for dry_run in (True, False):  # the dry run answered "would migrate"
        report = await engine.client.migrate([iid], to=v2, step_map=STEP_MAP, state_transform=add_currency,
                                             dry_run=dry_run)
        assert report.counts == {"refused": 1}
        assert "v2 is DEPRECATED" in report.outcomes[0].reason
    assert (await engine.client.get(iid)).version == 1
    assert [h["kind"] for h in await engine.client.history(iid)][-1] != "INSTANCE_MIGRATED"


async def test_dry_run_counts_honestly_and_writes_nothing(engine: Engine) -> None:
    ids = await _waiting(engine, 3)
    await engine.client.signal(ids[0], "go")
    await engine.run_until_idle()  # ids[0] completed: skipped
    report = await engine.client.migrate(to=v2, definition="mig", from_version=1, step_map=STEP_MAP,
                                         state_transform=add_currency, dry_run=True)
    assert report.counts == {"would migrate": 2}  # a completed instance is not a candidate
    assert {(await engine.client.get(i)).version for i in ids} == {1}
    report = await engine.client.migrate(ids, to=v2, step_map=STEP_MAP, state_transform=add_currency, dry_run=True)
    assert report.counts == {"skipped": 1, "would migrate": 2}


async def test_no_step_map_can_leave_an_unreachable_position(engine: Engine) -> None:
    """Try every target for the waiting position: whatever is accepted lands on a v2 step of the same
    kind that accepts the old signal; everything else is refused with the instance untouched."""
    targets = [*v2.plan.steps, "nowhere"]
    ids = await _waiting(engine, len(targets))
    for iid, goal in zip(ids, targets, strict=True):
        report = await engine.client.migrate([iid], to=v2, step_map={"w": goal, "b": "b2"},
                                             state_transform=add_currency)
        info = await engine.client.get(iid)
        if report.counts.get("migrated"):
            step = v2.plan.steps[info.step or ""]
            assert step.kind == "wait" and "go" in step.signals
            await engine.client.signal(iid, "go")
        else:
            assert (info.version, info.step) == (1, "w"), report
            await engine.client.signal(iid, "go")
    await engine.run_until_idle()
    infos = [await engine.client.get(i) for i in ids]
    assert [i.status for i in infos] == ["COMPLETED"] * len(ids)
    assert [i.version for i in infos].count(2) == 1  # only w -> w2 fits


async def test_migration_under_load_loses_nothing_and_migrates_nothing_twice(database_url: str) -> None:
    async with open_engine(database_url, Registry(v1, v2), concurrency=4, poll_interval=0.05) as engine:
        ids = [await engine.client.start(v1, {"amount": i}) for i in range(24)]
        worker = engine.new_worker(concurrency=4, poll_interval=0.05)
        await worker.start()
        try:
            async def signal_some() -> None:
                for iid in ids[::2]:
                    await engine.client.signal(iid, "go")
                    await asyncio.sleep(0)

            async def migrate_all() -> Any:
                return await engine.client.migrate(to=v2, definition="mig", from_version=1, step_map=STEP_MAP,
                                                   state_transform=add_currency)

            _, first, second = await asyncio.gather(signal_some(), migrate_all(), migrate_all())
            for iid in ids:
                with contextlib.suppress(InvalidState):  # the ones signalled first may have completed
                    await engine.client.signal(iid, "go", dedup_key=f"final/{iid}")
            infos = [await engine.client.wait_for(iid, timeout=30) for iid in ids]
        finally:
            await worker.stop()
        assert [i.status for i in infos] == ["COMPLETED"] * len(ids)
        migrated = 0
        for iid, info in zip(ids, infos, strict=True):
            entries = [h for h in await engine.client.history(iid) if h["kind"] == "INSTANCE_MIGRATED"]
            assert len(entries) <= 1
            migrated += len(entries)
            assert info.state["ran"] == ("v2" if entries else "v1")
            assert info.version == (2 if entries else 1)
        outcomes = first.counts.get("migrated", 0) + second.counts.get("migrated", 0)
        assert outcomes == migrated > 0
        assert "refused" not in first.counts and "refused" not in second.counts


async def test_a_replay_of_a_migrated_instance_starts_from_the_migrations_state(engine: Engine) -> None:
    """Replay rebuilt the state from the start's baseline and the patches, passing over the migration's
    baseline: a replay from `b2` ran on v1's state without its currency and failed ('stored state no longer
    fits the state model'), one from `w2` left the instance WAITING on that state. A step that last ran
    before the migration (its state the old version's, its step perhaps not the new one's) was accepted
    and failed the same way, or with UnknownStep for the renamed wait: it is refused, nothing changed."""
    [iid] = await _waiting(engine)
    await engine.client.migrate(iid, to=v2, step_map=STEP_MAP, state_transform=add_currency)
    await engine.client.signal(iid, "go")
    await engine.run_until_idle()
    done = await engine.client.get(iid)
    assert done.status == "COMPLETED"
    for step in ("w", "a"):
        with pytest.raises(InvalidState, match=rf"step '{step}' last ran before the instance migrated from v1 to v2 "
                                               r"\(history entry \d+\): .* replay from a step run since \(w2, b2\)"):
            await engine.client.replay(iid, step)
    assert await engine.client.get(iid) == done  # nothing changed
    await engine.client.replay(iid, "w2")  # its visit began on v1 and went on: from the migration's state
    await engine.run_until_idle()
    waiting = await engine.client.get(iid)
    assert (waiting.status, waiting.step, waiting.state) == ("WAITING", "w2", {"amount": 1, "currency": "EUR",
                                                                               "ran": ""})
    await engine.client.signal(iid, "stop")
    await engine.run_until_idle()
    await engine.client.replay(iid, "b2")
    await engine.run_until_idle()
    again = await engine.client.get(iid)
    assert (again.status, again.state) == ("COMPLETED", {"amount": 1, "currency": "EUR", "ran": "v2"})


async def test_a_batch_migration_takes_every_candidate_page_by_page(engine: Engine) -> None:
    """The batch form read at most 10,000 candidates (`limit`) and said nothing of the rest: a version with
    more instances was migrated in part, reported as if whole. It reads every one, in keyset pages, and a
    refused instance (it stays a candidate) does not stop the pages after it."""
    ids = await _waiting(engine, 5)

    def picky(state: dict[str, Any]) -> dict[str, Any]:
        if state["amount"] == 3:
            raise ValueError("not this one")
        return add_currency(state)

    report = await migration.migrate(engine.store.definitions, None, to=v2, definition="mig", from_version=1,
                                     step_map=STEP_MAP, state_transform=picky, page=2)
    assert [o.instance_id for o in report.outcomes] == ids  # oldest first, each once
    assert report.counts == {"migrated": 4, "refused": 1}


async def test_an_unknown_id_in_a_list_is_answered_and_the_others_go_on(engine: Engine) -> None:
    """An id of the list that names no instance raised InstanceNotFound out of the whole call: the ones before
    it were migrated with no report saying so, the ones after it were never tried."""
    first, last = await _waiting(engine, 2)
    missing = "00000000-0000-0000-0000-000000000000"
    report = await engine.client.migrate([first, missing, last], to=v2, step_map=STEP_MAP,
                                         state_transform=add_currency)
    assert [(o.instance_id, o.outcome, o.reason) for o in report.outcomes] == [
        (first, "migrated", ""), (missing, "refused", "no such instance"), (last, "migrated", "")]
    with pytest.raises(InstanceNotFound):  # one instance named alone: its own error
        await engine.client.migrate(missing, to=v2)
