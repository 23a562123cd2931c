"""What the docs promise and no test held to (issue 9, item 18).

Written against outcomes through the public store, client and worker API, so they hold
across rewrites of the claim and commit SQL.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta
from typing import Any

import pytest

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.core.effects import EndInstance, MovePosition, RecordHistory
from stepstone.core.model import Decision, Settle
from stepstone.errors import DefinitionConflict
from stepstone.runtime.committer import GroupCommitter
from stepstone.runtime.worker import Worker, WorkerConfig, pin_of
from stepstone.store.effects import commit_document
from stepstone.store.port import CommitRequest, Committed
from stepstone.testing import Engine
from tests.engine.conftest import Rows, kinds
from tests.engine.hardening import workflows as hw


def _one_step(step_name: str, workflow_id: str = "conflicting", version: int = 3) -> Workflow[Any]:
    wf: Workflow[Any] = Workflow(workflow_id, version=version)

    def handler(ctx: StepContext, state: Any) -> None:
        return None

    wf.step(handler, name=step_name, next=None)
    return wf


# -- a worker without the pinned plan defers, never fails --------------------------------------------------


async def test_a_worker_without_the_pinned_plan_defers_and_never_fails(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(hw.held_sync, {})
    before = await engine.client.get(iid)
    # A node that serves held_sync, but another version of it (a worker never claims a workflow it
    # does not serve at all: tests/registry/test_registry.py).
    lacking = Worker(engine.store, Registry(_one_step("other", "held_sync", version=2)),
                     WorkerConfig(worker_id="old-node", max_claims=1))
    # Its deferral gives its claim back (the command never dead-letters) and routes the command to the
    # workers that have its pin (migration 0076): this node never claims it again, however long it waits.
    for _ in range(4):
        await lacking.run_until_idle()
        assert lacking.events.deferred == 1 and lacking.events.commits == 0
        [cmd] = await rows.commands(iid)
        assert cmd["state"] == "DEFERRED" and cmd["deferrals"] == 1 and cmd["claims"] == 0
        assert cmd["last_error"].startswith("NOT_RUNNABLE") and "held_sync v1" in cmd["last_error"]
        await engine.move_clock(301)
    after = await engine.client.get(iid)
    assert (after.status, after.step, after.state, after.error) == (before.status, before.step, before.state, None)
    # Nothing happened to the instance, and the deferral says why it did not move (no plan on that node).
    assert kinds(await engine.client.history(iid)) == ["INSTANCE_STARTED", "COMMAND_DEFERRED"]

    # Another structure under the same id and version is "lacking the plan" too.
    other = _one_step("renamed", "held_sync", 1)
    different = Worker(engine.store, Registry(other), WorkerConfig(worker_id="other-structure"))
    second = await engine.client.start(hw.held_sync, {})
    await different.run_until_idle()
    assert different.events.deferred == 1 and different.events.commits == 0
    assert {c["state"] for c in await rows.commands(second)} == {"DEFERRED"}

    await engine.run_until_idle()  # a node that has the plan
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state == {"log": ["held"]}
    assert hw.RUNS[iid, "held_sync_step"] == 1
    assert (await engine.client.get(second)).status == "COMPLETED"


# -- registering the same id and version with another structure --------------------------------------------


async def test_same_id_and_version_with_another_structure_is_a_definition_conflict(engine: Engine) -> None:
    first, second, same = _one_step("a"), _one_step("b"), _one_step("a")
    await engine.store.register(pin_of(first), first.plan.document())
    await engine.store.register(pin_of(same), same.plan.document())  # same structure: fine, idempotent
    with pytest.raises(DefinitionConflict) as raised:
        await engine.store.register(pin_of(second), second.plan.document())
    assert (raised.value.definition_id, raised.value.version) == ("conflicting", 3)
    with pytest.raises(DefinitionConflict):
        await Worker(engine.store, Registry(second)).register()
    with pytest.raises(DefinitionConflict):
        await engine.client.start(second, {})
    assert await engine.client.list(definition="conflicting") == []


# -- expired leases are claimed before the backlog -------------------------------------------------------


async def test_expired_leases_are_claimed_before_older_ready_work(engine: Engine) -> None:
    dead = await engine.client.start(hw.held_sync, {})
    [claim] = await engine.store.claim(1, 30, "dead-worker")
    assert claim.instance.id == dead
    backlog = [await engine.client.start(hw.held_sync, {}) for _ in range(5)]
    await engine.move_clock(31)  # the dead worker's lease expired; the backlog became ready before that
    [first] = await engine.store.claim(1, 30, "rescuer")
    assert first.instance.id == dead and first.command.claims == 2
    rest = await engine.store.claim(10, 30, "rescuer")
    assert sorted(c.instance.id for c in rest) == sorted(backlog)


# -- the same idempotency key and outbox event id across retries and workers ----------------------------------


def _spy_commits(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str], bool]]:
    """(worker, event ids, committed) of every commit a worker sends, as sent."""
    sent: list[tuple[str, list[str], bool]] = []
    real = engine.store.commit

    async def commit(request: CommitRequest, **kw: Any) -> Committed | None:
        claim = request.claim
        doc = commit_document(
            request.decision, instance_id=claim.instance.id, position=claim.instance.position,
            command_id=request.command_id, token=claim.token, visit=request.visit,
            state_version=request.state_version, version=claim.pin.version, lease_seconds=kw["lease_seconds"],
            worker=kw["worker"],
        )
        result = await real(request, **kw)
        sent.append((kw["worker"], [e["event_id"] for e in doc.get("events", [])], result is not None))
        return result

    monkeypatch.setattr(engine.store, "commit", commit)
    return sent


async def test_idempotency_key_is_the_same_on_every_retry(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(hw.keyed, {})
    hw.FAIL_ONCE.add(iid)
    await engine.run_until_idle()
    await engine.move_clock(1.5)
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"
    [(attempt1, key1), (attempt2, key2)] = hw.KEYS[iid]
    assert (attempt1, attempt2) == (1, 2) and key1 == key2
    [payload] = [r["payload"] for r in await rows.conn.fetch("SELECT payload FROM stepstone.outbox")]
    assert json.loads(payload) == {"key": key1}


async def test_idempotency_key_and_event_id_are_the_same_on_another_worker(
    engine: Engine, rows: Rows, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = _spy_commits(engine, monkeypatch)
    iid = await engine.client.start(hw.keyed, {})
    gate = hw.GATE[iid] = hw.Gate()
    a = engine.new_worker(concurrency=1, lease_seconds=30, worker_id="worker-a")
    running = asyncio.create_task(a.run_until_idle())
    await asyncio.wait_for(gate.async_entered.wait(), 10)
    await engine.move_clock(31)  # worker A is presumed dead; B takes over and runs the step again
    b = engine.new_worker(concurrency=1, lease_seconds=30, worker_id="worker-b")
    await b.run_until_idle()
    gate.async_opened.set()
    await asyncio.wait_for(running, 10)

    assert a.events.fenced == 1 and b.events.commits == 1
    [(attempt_a, key_a), (attempt_b, key_b)] = hw.KEYS[iid]
    assert attempt_a == attempt_b == 1 and key_a == key_b
    [(worker_b, ids_b, committed_b), (worker_a, ids_a, committed_a)] = sent
    assert (worker_a, committed_a, worker_b, committed_b) == ("worker-a", False, "worker-b", True)
    assert ids_a == ids_b and len(ids_a) == 1
    stored = [str(r["event_id"]) for r in await rows.conn.fetch("SELECT event_id FROM stepstone.outbox")]
    assert stored == ids_b


# -- until= timers, end to end ---------------------------------------------------------------------------------


async def test_until_timer_fires_at_its_instant_on_the_database_clock(engine: Engine, rows: Rows) -> None:
    now = await engine.store.db_now()
    due = (now + timedelta(hours=1)).astimezone(datetime.now().astimezone().tzinfo)
    zoned = due.isoformat()
    iid = await engine.client.start(hw.until_wf, {"due": zoned})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "WAITING" and info.step == "sleep_until"
    assert info.next_timer_at == due

    await engine.move_clock(3600 - 5)
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "WAITING"
    await engine.move_clock(6)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["log"] == ["woke"]
    assert "TIMER_FIRED" in kinds(await engine.client.history(iid))


async def test_until_timer_in_the_past_fires_at_once(engine: Engine) -> None:
    past = (await engine.store.db_now() - timedelta(days=2)).isoformat()
    iid = await engine.client.start(hw.until_wf, {"due": past})
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"


# -- the group commit falls back to one-by-one -----------------------------------------------------------------


async def test_group_commit_falls_back_to_one_by_one_when_one_item_is_bad(
    engine: Engine, rows: Rows, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = [await engine.client.start(hw.held_sync, {}) for _ in range(3)]
    claims = {c.instance.id: c for c in await engine.store.claim(3, 30, "grouped")}
    assert sorted(claims) == sorted(ids)
    calls: list[tuple[str, int]] = []
    real_many, real_one = engine.store.commit_many, engine.store.commit

    async def commit_many(requests: list[CommitRequest], **kw: Any) -> list[Committed | None]:
        calls.append(("many", len(requests)))
        return await real_many(requests, **kw)

    async def commit(*args: Any, **kw: Any) -> Committed | None:
        calls.append(("one", 1))
        return await real_one(*args, **kw)

    monkeypatch.setattr(engine.store, "commit_many", commit_many)
    monkeypatch.setattr(engine.store, "commit", commit)

    def finish(kind: str | None) -> Decision:
        return Decision(Settle("COMPLETE"), (
            MovePosition("COMPLETED", None, 2), RecordHistory(kind, None, 2),  # type: ignore[arg-type]
            EndInstance("COMPLETED"),
        ))

    bad = ids[1]
    committer = GroupCommitter(engine.store, lease_seconds=30, worker="grouped")
    requests = [
        CommitRequest(claims[i], claims[i].command.id, finish(None if i == bad else "INSTANCE_COMPLETED"), 1)
        for i in ids
    ]
    results = await asyncio.gather(*(committer.commit(r) for r in requests), return_exceptions=True)

    assert calls == [("many", 3), ("one", 1), ("one", 1), ("one", 1)]
    for iid, result in zip(ids, results, strict=True):
        status = (await engine.client.get(iid)).status
        if iid == bad:
            assert isinstance(result, Exception) and status == "PENDING"
        else:
            assert isinstance(result, Committed) and status == "COMPLETED"
