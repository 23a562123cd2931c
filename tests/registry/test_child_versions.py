"""A child step starts its child on the version a start of that workflow in the parent's scope would get
(the scope's activation, else the default scope's, else the highest AVAILABLE version), never merely the
newest one the worker has; a version nothing can admit fails the step clearly (docs/versions.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from stepstone.authoring.workflow import Registry, Retry, StepContext, Workflow
from stepstone.core.pin import pin_of
from stepstone.errors import DatabaseUnavailable
from stepstone.testing import Engine, open_engine

KID_FAILS: set[str] = set()
"""While it holds "grow", every kid's step fails for good."""


def kid(version: int) -> Workflow[Any]:
    wf: Workflow[Any] = Workflow("kid", version=version)

    @wf.step(start=True, next=None, retry=Retry(max_attempts=1))
    def grow(ctx: StepContext, state: dict[str, Any]) -> None:
        if "grow" in KID_FAILS:
            raise RuntimeError("the kid cannot grow")
        state["kid_version"] = version

    return wf


parent: Workflow[Any] = Workflow("parent", version=1)


class _Count:
    count = 0


_SPAWNED = _Count()  # how often the child step's handler ran


@parent.child(workflow="kid", next="after", start=True)
def spawn(ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
    _SPAWNED.count += 1
    return {}


@parent.step(next=None)
def after(ctx: StepContext, state: dict[str, Any]) -> None:
    assert ctx.child is not None
    state["kid_version"] = ctx.child.state["kid_version"]


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    # kid v1 is recorded first, so it is the default scope's current version; v2 waits for an activation
    async with open_engine(database_url, Registry(kid(1), kid(2), parent), max_claims=2) as e:
        yield e


async def _run_parent(engine: Engine, scope: str = "default") -> tuple[Any, list[dict[str, Any]]]:
    """Run a parent to its end; it and its children (each with the version it is pinned to)."""
    iid = await engine.client.start(parent, {}, scope=scope)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    return info, [{**c, "version": (await engine.client.get(c["id"])).version} for c in info.children]


async def test_a_child_gets_the_current_version_as_a_start_does_not_the_newest_registered(engine: Engine) -> None:
    started = await engine.client.start("kid", {})
    info, [child] = await _run_parent(engine)
    assert (await engine.client.get(started)).version == 1
    assert info.status == "COMPLETED", info.error
    assert (child["version"], info.state["kid_version"]) == (1, 1)

    await engine.store.definitions.activate("default", "kid", 2)
    info, [child] = await _run_parent(engine)
    assert info.status == "COMPLETED", info.error
    assert (child["version"], info.state["kid_version"]) == (2, 2)


async def test_a_child_follows_the_activation_of_its_parents_scope(engine: Engine) -> None:
    await engine.store.definitions.activate("acme", "kid", 2, target_scope="default")
    info, [child] = await _run_parent(engine, scope="acme")
    assert info.status == "COMPLETED", info.error
    assert child["version"] == 2
    assert (await engine.client.detail(child["id"])).scope == "acme"
    info, [child] = await _run_parent(engine)  # the default scope still gets v1
    assert child["version"] == 1


async def test_deprecating_a_newer_child_version_leaves_parents_on_the_current_one(engine: Engine) -> None:
    await engine.store.definitions.transition("default", "kid", 2, "DEPRECATED")
    info, [child] = await _run_parent(engine)
    assert info.status == "COMPLETED", info.error
    assert child["version"] == 1
    history = [h["kind"] for h in await engine.client.history(info.id)]
    assert "COMMAND_DEAD_LETTERED" not in history


async def test_a_child_no_version_can_admit_fails_its_step_clearly_then_runs_once_one_can(engine: Engine) -> None:
    await engine.store.definitions.deactivate("default", "kid")
    for version in (1, 2):
        await engine.store.definitions.transition("default", "kid", version, "DEPRECATED")
    info, children = await _run_parent(engine)
    assert children == []
    assert info.status == "FAILED"
    assert info.error["type"] == "VersionNotAdmitted"
    message = info.error["message"]
    assert "child step 'spawn'" in message and "workflow 'kid'" in message and "scope default" in message
    assert "stepstone definitions reinstate kid" in message
    history = [h["kind"] for h in await engine.client.history(info.id)]
    assert "COMMAND_DEAD_LETTERED" not in history and history.count("STEP_FAILED") == 1  # not retried

    await engine.store.definitions.transition("default", "kid", 2, "AVAILABLE")
    await engine.client.retry(info.id)
    await engine.run_until_idle()
    info = await engine.client.get(info.id)
    assert info.status == "COMPLETED", info.error
    assert [(await engine.client.get(c["id"])).version for c in info.children] == [2]


async def test_a_worker_without_the_selected_child_version_retries_the_step_then_one_with_it_runs_it(
    engine: Engine, database_url: str
) -> None:
    """A rolling deploy: v3 of the child is recorded and activated by a deploy this worker is not part of."""
    newer = kid(3)
    await engine.store.register(pin_of(newer), newer.plan.document())
    await engine.store.definitions.activate("default", "kid", 3)
    iid = await engine.client.start(parent, {})
    await engine.run_until_idle()
    await engine.advance(minutes=5)  # the step's retries, each failing the same way
    info = await engine.client.get(iid)
    assert info.status == "FAILED" and info.children == []
    assert info.error["type"] == "DefinitionNotFound"
    message = info.error["message"]
    assert "child step 'spawn'" in message and "kid" in message and "deploy it to every worker" in message
    history = [h["kind"] for h in await engine.client.history(iid)]
    # each attempt failed the same way (retried: a deploy may catch up), then the instance, not a dead letter
    assert history == ["INSTANCE_STARTED", "STEP_FAILED", "STEP_FAILED", "STEP_FAILED", "INSTANCE_FAILED"]

    async with open_engine(database_url, Registry(kid(1), kid(2), newer, parent)) as deployed:
        await deployed.client.retry(iid)
        await deployed.run_until_idle()
        info = await deployed.client.get(iid)
        assert info.status == "COMPLETED", info.error
        assert info.state["kid_version"] == 3


async def test_a_connection_lost_while_choosing_the_childs_version_does_not_run_the_step_again(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child step's handler has run when its child's version is asked; a connection lost then crashed
    the segment, and the step ran again after its lease (the chaos rig's cut connections found it)."""
    definitions = engine.store.definitions
    asked = definitions.select_version
    failures = [DatabaseUnavailable("connection was closed in the middle of operation")]

    async def flaky(scope: str, definition_id: str) -> Any:
        if failures:
            raise failures.pop()
        return await asked(scope, definition_id)

    monkeypatch.setattr(definitions, "select_version", flaky)
    ran_before = _SPAWNED.count
    info, [_child] = await _run_parent(engine)
    assert info.status == "COMPLETED", info.error
    assert failures == [] and _SPAWNED.count - ran_before == 1
    history = [h["kind"] for h in await engine.client.history(info.id)]
    assert "STEP_FAILED" not in history and "COMMAND_DEAD_LETTERED" not in history


async def test_a_retried_child_step_names_the_version_its_existing_child_runs(engine: Engine) -> None:
    # The child failed on v1, so its parent failed; v2 was activated meanwhile. The operator retries the
    # child (it completes on v1), then the parent: its child step runs again at the same visit and names
    # the same child, which start_children does not start twice. Its CHILD_STARTED named v2, the version a
    # new start would get, not the one the child runs.
    KID_FAILS.add("grow")
    try:
        iid = await engine.client.start(parent, {})
        await engine.run_until_idle()
        info = await engine.client.get(iid)
        assert info.status == "FAILED", info
        [child] = info.children
        await engine.store.definitions.activate("default", "kid", 2)
        KID_FAILS.clear()
        await engine.client.retry(child["id"])
        await engine.run_until_idle()
        assert (await engine.client.get(child["id"])).status == "COMPLETED"
        await engine.client.retry(iid)
        await engine.run_until_idle()
    finally:
        KID_FAILS.clear()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["kid_version"] == 1, info
    assert [c["id"] for c in info.children] == [child["id"]]
    started = [h["data"] for h in await engine.client.history(iid) if h["kind"] == "CHILD_STARTED"]
    assert [(d["child_id"], d["version"]) for d in started] == [(child["id"], 1), (child["id"], 1)]


async def test_a_retried_child_step_whose_existing_child_runs_a_deprecated_version_goes_on_with_it(
    engine: Engine,
) -> None:
    """As above, with kid v1 deprecated before the parent's retry. The retried step names the child it
    started, on v1, which is not started again; the pin admission (the instances' BEFORE INSERT trigger,
    which fires before ON CONFLICT DO NOTHING finds the row) refused v1 all the same, every time the step
    ran again: the parent's commit never landed. Now the step commits and the parent goes on with the
    child it has, on the version it runs; no second child."""
    KID_FAILS.add("grow")
    try:
        iid = await engine.client.start(parent, {})
        await engine.run_until_idle()
        [child] = (await engine.client.get(iid)).children
        await engine.store.definitions.activate("default", "kid", 2)
        await engine.store.definitions.transition("default", "kid", 1, "DEPRECATED")
        KID_FAILS.clear()
        await engine.client.retry(child["id"])
        await engine.run_until_idle()
        assert (await engine.client.get(child["id"])).status == "COMPLETED"
        ran_before = _SPAWNED.count
        await engine.client.retry(iid)
        await engine.run_until_idle()
    finally:
        KID_FAILS.clear()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["kid_version"] == 1, info
    assert [c["id"] for c in info.children] == [child["id"]]
    assert (await engine.client.get(child["id"])).version == 1
    started = [h["data"] for h in await engine.client.history(iid) if h["kind"] == "CHILD_STARTED"]
    assert [(d["child_id"], d["version"]) for d in started] == [(child["id"], 1), (child["id"], 1)]
    assert (_SPAWNED.count - ran_before, engine.worker.events.crashed) == (1, 0)


async def test_a_child_version_deprecated_between_its_selection_and_the_commit_is_selected_again(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parent's worker selected kid v1 for the child; before its commit, v2 was activated and v1
    deprecated. The commit's start of the child was refused (VersionNotAdmitted): the segment crashed, its
    step waited for the lease to expire and its handler ran again. Now the worker selects again and commits
    in the same segment, without running the step's handler a second time (it ran twice, at the same
    visit, when the refusal ran the step again as a conflict on the shared state does): the child runs v2,
    and there is no crash and no failed step."""
    definitions = engine.store.definitions
    asked = definitions.select_version
    raced: list[int] = []

    async def then_deprecated(scope: str, definition_id: str) -> Any:
        chosen = await asked(scope, definition_id)
        if definition_id == "kid" and not raced:
            raced.append(chosen[1])
            await definitions.activate("default", "kid", 2)
            await definitions.transition("default", "kid", 1, "DEPRECATED")
        return chosen

    monkeypatch.setattr(definitions, "select_version", then_deprecated)
    ran_before = _SPAWNED.count
    iid = await engine.client.start(parent, {})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert raced == [1]
    assert info.status == "COMPLETED", info.error
    assert info.state["kid_version"] == 2
    assert [(await engine.client.get(c["id"])).version for c in info.children] == [2]
    history = await engine.client.history(iid)
    kinds = [h["kind"] for h in history]
    assert "STEP_FAILED" not in kinds and "COMMAND_DEAD_LETTERED" not in kinds, kinds
    assert [h["data"]["version"] for h in history if h["kind"] == "CHILD_STARTED"] == [2]
    assert engine.worker.events.crashed == 0
    assert _SPAWNED.count - ran_before == 1
