"""The plan a migration checks an instance's steps on is the one the instance is pinned to, by its plan hash.

An id the registry has never seen is admitted (an engine used without registration, migration 0008), so an
instance can be pinned to a plan that is not stored, and code of the same version with another structure
can be registered afterwards. The checks read the source plan by (scope, id, version) alone: they checked
such an instance against the other code's plan, and one with no plan stored against nothing at all.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.core.pin import pin_of
from stepstone.store.port import NewInstance
from stepstone.testing import Engine, open_engine

# What the instances run: v1 whose start step `a` is an action.
ran_v1: Workflow[Any] = Workflow("msp", version=1)
# Other code registered as v1 later (another plan hash): `a` is a wait there, as in v2.
other_v1: Workflow[Any] = Workflow("msp", version=1)
other_v1.wait("a", signals={"go": "done"}, start=True)
v2: Workflow[Any] = Workflow("msp", version=2)
v2.wait("a", signals={"go": "done"}, start=True)


@ran_v1.step(name="a", start=True, next="done")
async def a(_ctx: StepContext, _state: dict[str, Any]) -> None:
    pass


for _wf in (ran_v1, other_v1, v2):
    @_wf.step(name="done")
    async def done(_ctx: StepContext, _state: dict[str, Any]) -> None:
        pass


unrelated: Workflow[Any] = Workflow("msp_unrelated", version=1)
unrelated.wait("hold", signals={"go": "$end"}, start=True)


@pytest.fixture
async def engine(database_url: str) -> Any:
    async with open_engine(database_url, Registry(unrelated)) as e:
        yield e


async def _started_unregistered(engine: Engine) -> str:
    """An instance of ran_v1 started by an engine that never registered it (admitted: the id is new)."""
    iid = str(uuid.uuid4())
    await engine.store.start(NewInstance(iid, pin_of(ran_v1), {}, "a", None, None, None))
    return iid


async def test_an_instance_is_not_checked_against_another_plan_of_its_version(engine: Engine) -> None:
    """v1 is registered afterwards with other code, where `a` is a wait as in v2: checked on that plan, the
    instance's action step `a` passed for a wait and was moved to v2's wait. Its own plan is not stored, so
    its steps cannot be checked: refused, saying which plan is stored and which one it runs."""
    iid = await _started_unregistered(engine)
    await engine.store.register(pin_of(other_v1), other_v1.registration_document())
    report = await engine.client.migrate([iid], to=v2)
    [outcome] = report.outcomes
    stored, pinned = other_v1.plan.plan_hash[:12], ran_v1.plan.plan_hash[:12]
    assert (outcome.outcome, outcome.reason) == ("refused", (
        f"the instance runs 'msp' v1 with plan {pinned}, which is not stored (v1 is stored with plan {stored}): "
        "its steps cannot be checked; nothing was changed"))
    info = await engine.client.get(iid)
    assert (info.version, info.step) == (1, "a")


async def test_an_instance_whose_plan_is_not_stored_is_refused_not_moved_unchecked(engine: Engine) -> None:
    """With no v1 stored at all every step check was skipped and the instance migrated unchecked."""
    iid = await _started_unregistered(engine)
    report = await engine.client.migrate([iid], to=v2)
    [outcome] = report.outcomes
    assert (outcome.outcome, outcome.reason) == ("refused", (
        f"the instance runs 'msp' v1 with plan {ran_v1.plan.plan_hash[:12]}, which is not stored (no v1 is): its "
        "steps cannot be checked; register that version's code, then migrate; nothing was changed"))
    assert (await engine.client.get(iid)).version == 1
    # Once its code is registered, the checks run on it: the action step does not map to v2's wait.
    await engine.store.register(pin_of(ran_v1), ran_v1.registration_document())
    [checked] = (await engine.client.migrate([iid], to=v2)).outcomes
    assert (checked.outcome, checked.reason) == ("refused", "step 'a' is a action step, 'a' in v2 a wait")
