"""The definitions registry: recording, drift, lifecycle rules, activations, selection, pin admission, scopes."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from click.testing import CliRunner

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.cli import cli
from stepstone.core.pin import pin_of
from stepstone.errors import (
    DefinitionConflict,
    DefinitionDrift,
    DefinitionNotFound,
    InvalidTransition,
    VersionNotAdmitted,
)
from stepstone.runtime.worker import Worker
from stepstone.testing import Engine, open_engine


def flow(version: int, *, second: str = "b", definition_id: str = "orders") -> Workflow[Any]:
    wf: Workflow[Any] = Workflow(definition_id, version=version)

    @wf.step(start=True, next=second)
    async def a(ctx: StepContext, state: dict[str, Any]) -> None:
        state["ran"] = ctx.workflow

    @wf.step(name=second)
    async def end(ctx: StepContext, state: dict[str, Any]) -> None:
        state["version"] = version

    return wf


V1, V2 = flow(1), flow(2)


@pytest.fixture
async def engine(database_url: str) -> Any:
    async with open_engine(database_url, Registry(V1, V2)) as e:
        yield e


async def _status(engine: Engine, version: int, scope: str = "default") -> str:
    return str((await engine.store.definitions.find(scope, "orders", version))["status"])


async def test_a_worker_records_its_code_definitions_and_the_first_version_is_activated(engine: Engine) -> None:
    records = await engine.store.definitions.records(definition_id="orders")
    assert [(r.version, r.kind, r.status, r.active) for r in records] == [
        (1, "CODE", "AVAILABLE", True), (2, "CODE", "AVAILABLE", False)]
    assert records[0].plan_hash == V1.plan.plan_hash
    assert await engine.store.definitions.select_version("default", "orders") == ("default", 1, V1.plan.plan_hash)


async def test_a_changed_structure_under_the_same_version_is_drift_and_the_worker_does_not_start(
    engine: Engine,
) -> None:
    drifted = flow(1, second="c")
    worker = Worker(engine.store, Registry(drifted))
    with pytest.raises(DefinitionDrift) as raised:
        await worker.start()
    message = str(raised.value)
    assert message.startswith("drift: workflow 'orders' v1")
    assert V1.plan.plan_hash[:12] in message and drifted.plan.plan_hash[:12] in message
    assert isinstance(raised.value, DefinitionConflict)
    assert (await engine.store.definitions.find("default", "orders", 1))["plan_hash"] == V1.plan.plan_hash


async def test_a_start_by_id_follows_the_activation_and_pins_the_version(engine: Engine) -> None:
    first = await engine.client.start("orders", {})
    await engine.store.definitions.activate("default", "orders", 2)
    second = await engine.client.start("orders", {})
    await engine.run_until_idle()
    assert (await engine.client.get(first)).state["version"] == 1
    assert (await engine.client.get(second)).state["version"] == 2


async def test_a_scope_follows_the_default_until_it_has_its_own_activation(engine: Engine) -> None:
    await engine.store.definitions.activate("acme", "orders", 2, target_scope="default")
    acme = await engine.client.start("orders", {}, scope="acme")
    other = await engine.client.start("orders", {}, scope="globex")
    await engine.run_until_idle()
    assert (await engine.client.get(acme)).version == 2
    assert (await engine.client.get(other)).version == 1
    assert [r["id"] for r in await engine.client.list(scope="acme")] == [acme]
    assert {r["id"] for r in await engine.client.list()} == {acme, other}
    await engine.store.definitions.deactivate("acme", "orders")
    assert await engine.store.definitions.select_version("acme", "orders") == ("default", 1, V1.plan.plan_hash)


async def test_pin_admission_refuses_a_deprecated_or_retired_version(engine: Engine) -> None:
    await engine.store.definitions.activate("default", "orders", 2)
    await engine.store.definitions.transition("default", "orders", 1, "DEPRECATED")
    with pytest.raises(VersionNotAdmitted, match="v1 is DEPRECATED"):
        await engine.client.start(V1, {})
    await engine.store.definitions.transition("default", "orders", 1, "RETIRED")
    with pytest.raises(VersionNotAdmitted, match="v1 is RETIRED"):
        await engine.client.start(V1, {})
    assert await engine.client.list() == []  # nothing was written
    assert await engine.client.start(V2, {})


async def test_pin_admission_refuses_a_drifted_pin(engine: Engine) -> None:
    drifted = flow(2, second="z")
    client = type(engine.client)(engine.store, Registry(drifted))
    client._registered.add(("orders", 2))  # skip the registration, as another node would
    with pytest.raises(DefinitionDrift, match="structure changed without a version bump"):
        await client.start(drifted, {})


async def test_lifecycle_rules(engine: Engine) -> None:
    d = engine.store.definitions
    with pytest.raises(InvalidTransition, match="current version of scope"):
        await d.transition("default", "orders", 1, "DEPRECATED")  # the default scope's activation names it
    with pytest.raises(InvalidTransition, match="deprecate it before retiring"):
        await d.transition("default", "orders", 2, "RETIRED")
    iid = await engine.client.start(V2, {})
    await d.transition("default", "orders", 2, "DEPRECATED")
    with pytest.raises(InvalidTransition, match="still pins 1 instance"):
        await d.transition("default", "orders", 2, "RETIRED")
    await engine.run_until_idle()  # deprecated versions still run what they pin
    assert (await engine.client.get(iid)).status == "COMPLETED"
    assert await d.transition("default", "orders", 2, "RETIRED") == "DEPRECATED"
    with pytest.raises(DefinitionDrift):
        await d.transition("default", "orders", 2, "AVAILABLE", plan_hash=flow(2, second="q").plan.plan_hash)
    assert await d.transition("default", "orders", 2, "AVAILABLE", plan_hash=V2.plan.plan_hash) == "RETIRED"
    with pytest.raises(DefinitionDrift, match="it is AVAILABLE, but that code is not this version"):
        await d.transition("default", "orders", 2, "AVAILABLE", plan_hash=flow(2, second="q").plan.plan_hash)
    assert await d.transition("default", "orders", 2, "AVAILABLE", plan_hash=V2.plan.plan_hash) == "AVAILABLE"
    with pytest.raises(InvalidTransition, match="cannot become CANDIDATE"):
        await d.transition("default", "orders", 2, "CANDIDATE")
    with pytest.raises(DefinitionNotFound):
        await d.transition("default", "orders", 9, "DEPRECATED")


async def test_an_activation_must_name_an_available_version(engine: Engine) -> None:
    d = engine.store.definitions
    await d.activate("default", "orders", 2)
    await d.transition("default", "orders", 1, "DEPRECATED")
    with pytest.raises(InvalidTransition, match="it is DEPRECATED"):
        await d.activate("acme", "orders", 1, target_scope="default")
    with pytest.raises(InvalidTransition, match="it is not registered"):
        await d.activate("default", "orders", 7)
    with pytest.raises(InvalidTransition, match="own rows or the default"):
        await d.activate("acme", "orders", 2, target_scope="globex")
    assert [(a["scope"], a["version"]) for a in await d.activations(definition_id="orders")] == [("default", 2)]


async def test_a_start_by_id_whose_selected_version_the_client_lacks_is_refused(engine: Engine) -> None:
    await engine.store.definitions.activate("default", "orders", 2)
    client = type(engine.client)(engine.store, Registry(V1))
    with pytest.raises(DefinitionNotFound, match="v2 is the version scope default selects"):
        await client.start("orders", {})


async def test_heartbeat_and_stranded_report(engine: Engine) -> None:
    d = engine.store.definitions
    await engine.client.start(V1, {})
    await engine.client.start(V1, {})
    stranded = await d.stranded(60)
    assert [(s.pin.version, s.instances) for s in stranded] == [(1, 2)]
    await d.heartbeat("w1", [pin_of(V1)])
    assert await d.stranded(60) == []
    await engine.move_clock(120)
    assert [(s.pin.version, s.instances) for s in await d.stranded(60)] == [(1, 2)]
    await d.forget_worker("w1")
    assert await d.served(3600) == []


async def test_a_worker_without_the_pinned_plan_defers_once_and_never_fails_it(engine: Engine) -> None:
    only_v1 = Worker(engine.store, Registry(V1))
    iid = await engine.client.start(V2, {})
    rows = []
    for _ in range(3):
        await only_v1.run_until_idle()
        rows.append(await _command(engine, iid))
        await engine.move_clock(301)
    # Deferred once, to the route of its pin (migration 0076): a worker without v2 never claims it again.
    assert [(r["state"], r["deferrals"]) for r in rows] == [("DEFERRED", 1)] * 3 and only_v1.events.claims == 1
    assert rows[0]["wait"] <= 0  # no backoff: claimable at once by a worker that has v2
    assert rows[0]["last_error"].startswith("NOT_RUNNABLE: this node has no plan orders v2")
    assert (await engine.client.get(iid)).status == "PENDING"
    deferred = [h for h in await engine.client.history(iid) if h["kind"] == "COMMAND_DEFERRED"]
    assert [(h["data"]["deferrals"], h["data"]["backoff_seconds"]) for h in deferred] == [(1, 0)]
    pin = pin_of(V2.plan)
    assert {k: deferred[0]["data"]["pin"][k] for k in ("definition_id", "version", "plan_hash")} == {
        "definition_id": "orders", "version": 2, "plan_hash": pin.plan_hash}
    assert deferred[0]["data"]["kind"] == "START" and deferred[0]["data"]["reason"] == rows[0]["last_error"]
    with_v2 = Worker(engine.store, Registry(V2))
    await with_v2.start()  # a worker with the plan comes up: it walks the route of its pin
    try:
        info = await engine.client.wait_for(iid, timeout=20)
    finally:
        await with_v2.stop()
    assert info.status == "COMPLETED"


async def test_a_command_deferred_again_on_its_route_backs_off(engine: Engine) -> None:
    # Only a claim given no served list (a script's store.claim) walks a route without having its pin. Such
    # a deferral backs off as before routing: 0.25 s * 2^n, at most 1 s, while a worker that has the pin
    # heartbeats, else 5 s * 2^n (migration 0070), so that nothing claims and defers it in a loop.
    d = engine.store.definitions
    iid = await engine.client.start(V2, {})
    waits = []
    for n in range(5):
        if n < 4:
            await d.heartbeat("new-release", [pin_of(V2)])
        else:
            await engine.move_clock(31)  # the new release's last heartbeat is now over 30 s old
        [claim] = await engine.store.claim(1, 30, "any")
        await engine.store.defer(claim.instance.id, claim.instance.position, claim.token, "NOT_RUNNABLE: lacks it")
        row = await _command(engine, iid)
        waits.append(row["backoff"])
        await engine.move_clock(max(row["wait"], 0) + 0.01)
    assert waits == [0, 0.5, 1, 1, 80]  # the first routes it: no backoff
    history = await engine.client.history(iid)
    assert [h["data"]["backoff_seconds"] for h in history if h["kind"] == "COMMAND_DEFERRED"] == [0, 0.5, 1, 1, 80]


async def test_a_worker_never_claims_a_workflow_it_does_not_serve(engine: Engine) -> None:
    # Workers serving different workflows share one database: each runs its own, the other's
    # commands stay untouched (no deferral, no claim), so neither waits on the other's heartbeat.
    other = flow(1, definition_id="invoices")
    stranger, owner = Worker(engine.store, Registry(V1)), Worker(engine.store, Registry(other))
    iid = await engine.client.start(other, {})
    await stranger.run_until_idle()
    row = await _command(engine, iid)
    assert (row["state"], row["deferrals"], row["last_error"]) == ("PENDING", 0, None)
    assert stranger.events.claims == 0
    await owner.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"


async def _command(engine: Engine, iid: str) -> dict[str, Any]:
    pool = engine.store.pool  # type: ignore[attr-defined]
    row = await pool.fetchrow(
        "SELECT state, last_error, deferrals, EXTRACT(EPOCH FROM available_at - stepstone.db_now())::float8 AS wait, "
        # from its last deferral, which set available_at: `wait` is less by the real time since then
        "EXTRACT(EPOCH FROM available_at - (SELECT max(h.at) FROM stepstone.history h "
        "WHERE h.instance_id = c.instance_id AND h.kind = 'COMMAND_DEFERRED'))::float8 AS backoff "
        "FROM stepstone.commands c WHERE instance_id = $1 AND kind = 'START'", uuid.UUID(iid))
    return dict(row)


DRIFTED = Registry(flow(1, second="c"))


def test_the_worker_command_refuses_drift_in_one_line(database_url: str) -> None:
    runner = CliRunner()
    first = runner.invoke(cli, ["definitions", "list", "--database-url", database_url])
    assert first.exit_code == 0 and "no definitions recorded" in first.stdout
    asyncio.run(_record_v1(database_url))
    result = runner.invoke(cli, ["worker", "--app", "tests.registry.test_registry:DRIFTED",
                                 "--database-url", database_url])
    assert result.exit_code == 1
    [line] = result.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: drift: workflow 'orders' v1 (scope default) is registered with plan ")
    assert "give it a new version (nothing was re-pinned)" in line


async def _record_v1(database_url: str) -> None:
    async with open_engine(database_url, Registry(V1)):
        pass
