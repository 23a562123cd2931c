"""A command deferred for want of its plan is routed to the workers that have the plan (migration 0076):
its queue key (commands.definition) becomes its pin's route, which only the workers that have the pin
name among the keys they serve, so a worker of the other release claims it once and never again."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import pytest

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.core.pin import pin_of
from stepstone.ops import Operations
from stepstone.runtime.worker import Worker
from stepstone.store.health import deferred_pins
from stepstone.store.operations_port import InstanceFilter
from stepstone.testing import Engine, open_engine
from tests.perf.generic_plans import function_statement, plan_nodes

GO = "go"


def routed(version: int) -> Workflow[Any]:
    wf: Workflow[Any] = Workflow("routed", version=version)

    @wf.step(start=True, next="w")
    async def a(ctx: StepContext, state: dict[str, Any]) -> None:
        state["a"] = version

    wf.wait("w", signals={GO: "b"})

    @wf.step(name="b")
    async def b(ctx: StepContext, state: dict[str, Any]) -> None:
        state["b"] = version

    return wf


R1, R2 = routed(1), routed(2)


@pytest.fixture
async def engine(database_url: str) -> Any:
    async with open_engine(database_url, Registry(R1, R2)) as e:
        yield e


async def _commands(engine: Engine, iid: str) -> list[dict[str, Any]]:
    pool = engine.store.pool  # type: ignore[attr-defined]
    rows = await pool.fetch(
        "SELECT kind, state, definition, deferrals, "
        "EXTRACT(EPOCH FROM available_at - stepstone.db_now())::float8 AS wait, "
        # from the instance's last deferral, which set available_at: `wait` is less by the real time since then
        "EXTRACT(EPOCH FROM available_at - (SELECT max(h.at) FROM stepstone.history h "
        "WHERE h.instance_id = c.instance_id AND h.kind = 'COMMAND_DEFERRED'))::float8 AS backoff "
        "FROM stepstone.commands c WHERE instance_id = $1 ORDER BY seq, id", uuid.UUID(iid))
    return [dict(r) for r in rows]


async def _deferred_by_the_other_release(engine: Engine, to: Workflow[Any], lacking: Workflow[Any]) -> str:
    """An instance of `to`, its signal queued behind its start, deferred once by a worker that has `lacking` alone."""
    iid = await engine.client.start(to, {})
    await engine.client.signal(iid, GO, {}, dedup_key="go")
    other = Worker(engine.store, Registry(lacking))
    await other.run_until_idle()
    assert other.events.deferred == 1
    return iid


async def test_beside_a_live_worker_of_its_release_the_other_release_claims_a_command_once(engine: Engine) -> None:
    # A rolling deploy: a worker of the new release heartbeats v2 while one of the old release (v1 alone)
    # claims again and again, a second apart. Before routing, each of its claims took the v2 start back
    # (0.25 s, 0.5 s, 1 s backoffs: four deferrals); now the first deferral routes it to v2's workers.
    await engine.store.definitions.heartbeat("new-release", [pin_of(R2)])
    old, new = Worker(engine.store, Registry(R1)), Worker(engine.store, Registry(R2))
    iid = await engine.client.start(R2, {})
    await engine.client.signal(iid, GO, {}, dedup_key="go")
    for _ in range(4):
        await old.run_until_idle()
        await engine.move_clock(1.01)
    assert (old.events.claims, old.events.deferred) == (1, 1)
    start, signal = await _commands(engine, iid)
    assert (start["kind"], start["state"], start["deferrals"]) == ("START", "DEFERRED", 1)
    # The start and the signal queued behind it wait under v2's route, claimable at once by a worker of v2.
    assert start["definition"] == signal["definition"] == pin_of(R2).route == f"routed@2@{R2.plan.plan_hash}"
    assert start["wait"] <= 0
    deferred = [h for h in await engine.client.history(iid) if h["kind"] == "COMMAND_DEFERRED"]
    assert [(h["data"]["deferrals"], h["data"]["backoff_seconds"]) for h in deferred] == [(1, 0)]
    await new.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.state) == ("COMPLETED", {"a": 2, "b": 2})
    assert old.events.claims == 1 and new.events.deferred == 0


async def test_a_worker_wakes_for_the_routes_of_its_own_pins_alone(engine: Engine) -> None:
    old, new = Worker(engine.store, Registry(R1)), Worker(engine.store, Registry(R2))
    assert new.served == ["routed", pin_of(R2).route]
    old._on_due(0.0, pin_of(R2).route)
    new._on_due(0.0, pin_of(R2).route)
    assert (old._wake.is_set(), new._wake.is_set()) == (False, True)


async def test_with_no_worker_of_its_release_a_routed_command_stays_visible_and_runs_when_one_comes(
        engine: Engine) -> None:
    iid = await _deferred_by_the_other_release(engine, R2, R1)
    [stranded] = await engine.store.definitions.stranded(60)
    assert (stranded.pin.version, stranded.instances, stranded.deferred_commands) == (2, 1, 1)
    conn = await engine.store.pool.acquire()  # type: ignore[attr-defined]
    try:  # what `stepstone doctor` lists
        [deferred] = await deferred_pins(conn, "stepstone")
    finally:
        await engine.store.pool.release(conn)  # type: ignore[attr-defined]
    assert (deferred.pin.version, deferred.commands) == (2, 1)
    new = Worker(engine.store, Registry(R2))
    await new.start()
    try:
        info = await engine.client.wait_for(iid, timeout=20)
    finally:
        await new.stop()
    assert (info.status, info.state) == ("COMPLETED", {"a": 2, "b": 2})


async def test_a_migration_moves_the_routed_commands_back_to_the_definition(engine: Engine) -> None:
    iid = await _deferred_by_the_other_release(engine, R1, R2)  # v2's worker lacks v1
    assert {c["definition"] for c in await _commands(engine, iid)} == {pin_of(R1).route}
    report = await engine.client.migrate(iid, to=R2)
    assert report.counts == {"migrated": 1}
    assert {c["definition"] for c in await _commands(engine, iid) if c["kind"] != "MIGRATION"} == {"routed"}
    new = Worker(engine.store, Registry(R2))
    await new.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.state) == ("COMPLETED", {"a": 2, "b": 2})
    assert new.events.deferred == 0


async def test_a_worker_of_an_earlier_release_still_takes_routed_commands(engine: Engine) -> None:
    # Its served list names definition ids alone: the claim adds their routes, so a rollback strands nothing.
    # One that lacks the plan defers it again on its route, with the backoff: it cannot loop on it.
    iid = await _deferred_by_the_other_release(engine, R2, R1)
    [claim] = await engine.store.claim(4, 30, "earlier-release", ["routed"])
    assert str(claim.instance.id) == iid
    await engine.store.defer(claim.instance.id, claim.instance.position, claim.token, "NOT_RUNNABLE: lacks it")
    start, _ = await _commands(engine, iid)
    assert (start["state"], start["deferrals"], start["definition"]) == ("DEFERRED", 2, pin_of(R2).route)
    assert start["backoff"] == 10  # min(5 s * 2^1, 5 min): no worker of v2 heartbeats
    await engine.move_clock(11)
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"


async def test_the_probe_of_one_workflow_sees_its_routed_commands(engine: Engine) -> None:
    iid = await _deferred_by_the_other_release(engine, R2, R1)
    report = await Operations.on(engine.store, actor="oncall").probe(where=InstanceFilter(workflow="routed"))
    assert not report.idle and [c["instance_id"] for c in report.claimable] == [iid]


async def _route_probes(engine: Engine, served: list[str]) -> int:
    """How many keys the claim's walk probes in commands_ready for the served list `served` (the most loops
    of a scan of that index in its plan: one a walked key), rolled back."""
    conn: asyncpg.Connection = await engine.store.pool.acquire()  # type: ignore[attr-defined]
    try:
        await conn.execute(f"PREPARE claim AS {await function_statement(conn, 'claim_heads')}")
        keys = "ARRAY[" + ", ".join("'" + k.replace("'", "''") + "'" for k in served) + "]::text[]"
        transaction = conn.transaction()
        await transaction.start()
        try:  # the plan is decoded by the pool
            plan = await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE claim(8, 30.0, 'probes', {keys})")
        finally:
            await transaction.rollback()
    finally:
        await conn.execute("DEALLOCATE claim")
        await engine.store.pool.release(conn)  # type: ignore[attr-defined]
    return max(n.get("Actual Loops", 0) for n in plan_nodes(plan[0]["Plan"]) if n.get("Index Name") == "commands_ready")


async def test_a_claim_probes_no_route_that_holds_no_ready_command(engine: Engine) -> None:
    # A worker of both versions serves the definition id and two routes. Nothing routed: its claim probes
    # the id alone (before migration 0085 it probed all three keys, the two routes empty). A route that
    # holds a ready command is probed again, and the other one still not.
    served = Worker(engine.store, Registry(R1, R2)).served
    assert served == ["routed", pin_of(R1).route, pin_of(R2).route]
    for _ in range(3):
        await engine.client.start(R1, {})
    assert await _route_probes(engine, served) == 1
    iid = await _deferred_by_the_other_release(engine, R2, R1)
    assert {c["definition"] for c in await _commands(engine, iid)} == {pin_of(R2).route}
    assert await _route_probes(engine, served) == 2
    both = Worker(engine.store, Registry(R1, R2))
    await both.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED" and both.events.deferred == 0


async def test_a_definitions_routes_are_the_same_for_the_probe_and_an_earlier_release(engine: Engine) -> None:
    # Found right, held: the routes of one workflow with ready work, which the probe filtered by that
    # workflow walks and which a worker of an earlier release is given, are its own, never those of a
    # workflow whose id begins with its id (`routed-b`). One function finds them (ready_routes, 0085).
    other: Workflow[Any] = Workflow("routed-b", version=1)

    @other.step(start=True)
    async def only(ctx: StepContext, state: dict[str, Any]) -> None:
        state["b"] = 1

    await Worker(engine.store, Registry(other)).register()
    iid = await _deferred_by_the_other_release(engine, R2, R1)
    await engine.client.start(other, {})
    [claim] = await engine.store.claim(4, 30, "lacks-routed-b", ["routed-b"])
    await engine.store.defer(claim.instance.id, claim.instance.position, claim.token, "NOT_RUNNABLE: lacks it")
    pool = engine.store.pool  # type: ignore[attr-defined]
    routes = await pool.fetchval("SELECT stepstone.ready_routes(NULL)")
    assert sorted(routes) == sorted([pin_of(R2).route, pin_of(other).route])
    assert await pool.fetchval("SELECT stepstone.ready_routes(ARRAY['routed'])") == [pin_of(R2).route]
    served = await pool.fetchval("SELECT stepstone.served_with_routes(ARRAY['routed'])")
    assert sorted(served) == sorted(["routed", pin_of(R1).route, pin_of(R2).route])
    report = await Operations.on(engine.store, actor="oncall").probe(where=InstanceFilter(workflow="routed"))
    assert [c["instance_id"] for c in report.claimable] == [iid]


async def test_work_routed_to_a_plan_no_worker_serves_is_sampled_apart_from_the_pending_work(engine: Engine) -> None:
    # A v1-only worker routes a v2 start (and the signal queued behind it) to v2's route, and no worker of v2
    # has heartbeated: no worker will take them. Before, the sample's oldest pending command was the
    # stranded start, aging as long as no v2 worker came (`stepstone_oldest_pending_seconds` 600 s here);
    # now they are counted apart, and the oldest pending command is the one a live worker can take.
    iid = await _deferred_by_the_other_release(engine, R2, R1)
    await engine.move_clock(600)
    takeable = await engine.client.start(R1, {})
    await engine.move_clock(5)
    sample = await engine.store.sample()  # type: ignore[attr-defined]
    assert round(sample["oldest_pending_seconds"]) == 5
    assert (sample["stranded_commands"], round(sample["oldest_stranded_seconds"])) == (2, 605)
    metrics = pytest.importorskip("stepstone.observability.metrics").WorkerMetrics()
    metrics.record_sample(sample)
    assert metrics.registry.get_sample_value("stepstone_stranded_commands") == 2
    assert round(metrics.registry.get_sample_value("stepstone_oldest_stranded_seconds")) == 605
    # A worker that has the plan heartbeats: the routed work is pending work again, the oldest.
    await engine.store.definitions.heartbeat("new-release", [pin_of(R2)])
    sample = await engine.store.sample()  # type: ignore[attr-defined]
    assert round(sample["oldest_pending_seconds"]) == 605
    assert (sample["stranded_commands"], sample["oldest_stranded_seconds"]) == (0, None)
    await Worker(engine.store, Registry(R1, R2)).run_until_idle()
    assert [(await engine.client.get(i)).status for i in (iid, takeable)] == ["COMPLETED", "WAITING"]
