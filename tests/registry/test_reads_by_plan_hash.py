"""The operator's reads of an instance's plan data use the plan it is pinned to (by its plan hash).

An id the registry has never seen is admitted (an engine used without registration, migration 0008), so an
instance can run a plan that is not stored while the version is stored later with other code (another
plan hash; docs/versions.md). The views' redaction, the detail's retry limits, a replay's sensitive paths
and the pinned contract were read by (scope, id, version) alone: that other code's data.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import pytest
from pydantic import BaseModel

from stepstone.authoring.sensitive import Sensitive
from stepstone.authoring.workflow import Registry, Retry, StepContext, Workflow
from stepstone.core.pin import pin_of
from stepstone.core.redaction import REDACTED
from stepstone.errors import InvalidState, UnknownSignal
from stepstone.ops import Operations
from stepstone.store.factory import operations_store
from stepstone.store.management import open_management
from stepstone.store.port import NewInstance
from stepstone.testing import Engine, open_engine


class Secretive(BaseModel):
    secret: Annotated[str, Sensitive]
    note: str = ""


class Plain(BaseModel):
    secret: str = ""
    note: str = ""


class Noted(BaseModel):
    secret: Annotated[str, Sensitive] = ""
    note: Annotated[str, Sensitive] = ""


# What the instance runs: `secret` is sensitive, `a` tries 3 times.
ran_v1: Workflow[Any] = Workflow("rph", version=1, state=Secretive)
# Other code registered as v1 later (another plan hash): nothing sensitive, `a` tries 7 times, a signal `go`.
other_v1: Workflow[Any] = Workflow("rph", version=1, state=Plain)
other_v1.wait("hold", signals={"go": "$end"})
# Another version of the workflow, where `secret` is sensitive as in ran_v1, and `note` too.
v2: Workflow[Any] = Workflow("rph", version=2, state=Noted)


@ran_v1.step(name="a", start=True, next=None, retry=Retry(max_attempts=3))
async def a(_ctx: StepContext, _state: Any) -> None:
    pass


@other_v1.step(name="a", start=True, next="hold", retry=Retry(max_attempts=7))
async def other_a(_ctx: StepContext, _state: Any) -> None:
    pass


@v2.step(name="a", start=True, next=None)
async def a2(_ctx: StepContext, _state: Any) -> None:
    pass


unrelated: Workflow[Any] = Workflow("rph_unrelated", version=1)
unrelated.wait("hold", signals={"go": "$end"}, start=True)

STATE = {"secret": "s3cr3t-canary", "note": "a note"}


@pytest.fixture
async def engine(database_url: str) -> Any:
    async with open_engine(database_url, Registry(unrelated)) as e:
        yield e


async def _started_unregistered(engine: Engine) -> str:
    """An instance of ran_v1 started by an engine that never registered it (admitted: the id is new); then
    other code is registered as v1, and v2."""
    iid = str(uuid.uuid4())
    await engine.store.start(NewInstance(iid, pin_of(ran_v1), dict(STATE), "a", None, None, None))
    await engine.store.register(pin_of(other_v1), other_v1.registration_document())
    await engine.store.register(pin_of(v2), v2.registration_document())
    return iid


async def test_views_of_an_instance_whose_plan_is_not_stored_redact_every_stored_plans_paths(engine: Engine) -> None:
    """Redacted by other_v1's paths (none), the views showed the secret ran_v1 (and v2) mark sensitive. Its own
    paths are unknown: they redact by every path a stored plan of the workflow marks (v2's here)."""
    iid = await _started_unregistered(engine)
    redaction = (await open_management(engine.store).redactions([iid]))[iid]
    assert sorted(redaction.paths) == [("note",), ("secret",)]
    detail = await Operations.on(engine.store).detail(iid)
    assert detail.state == {"secret": REDACTED, "note": REDACTED}
    extra = await operations_store(engine.store).instance_extra(iid)
    assert sorted(extra["sensitive"]) == [["note"], ["secret"]]


async def test_views_of_an_instance_whose_plan_is_stored_redact_by_its_own_paths(engine: Engine) -> None:
    await engine.store.register(pin_of(ran_v1), ran_v1.registration_document())
    await engine.store.register(pin_of(v2), v2.registration_document())
    iid = str(uuid.uuid4())
    await engine.store.start(NewInstance(iid, pin_of(ran_v1), dict(STATE), "a", None, None, None))
    assert (await open_management(engine.store).redactions([iid]))[iid].paths == (("secret",),)
    assert (await Operations.on(engine.store).detail(iid)).state == {"secret": REDACTED, "note": "a note"}
    extra = await operations_store(engine.store).instance_extra(iid)
    assert (extra["sensitive"], extra["max_attempts"], extra["plan_stored"]) == ([["secret"]], {"a": 3}, True)


async def test_another_plans_retry_limits_are_not_shown(engine: Engine) -> None:
    """The detail's retry limits came from other_v1 (`a` tries 7 times); the instance's own limit is unknown."""
    iid = await _started_unregistered(engine)
    extra = await operations_store(engine.store).instance_extra(iid)
    assert extra["max_attempts"] is None
    assert extra["plan_stored"] is False


async def test_a_replay_is_refused_rather_than_run_with_another_plans_sensitive_paths(engine: Engine) -> None:
    """A replay restores the sensitive values history never held from the live state, at the plan's paths:
    with other_v1's (none) it went ahead. The instance's own paths are unknown: refused, nothing changed."""
    iid = await _started_unregistered(engine)
    ops = Operations.on(engine.store)
    await ops.cancel([iid])
    before = await engine.client.get(iid)
    with pytest.raises(InvalidState) as refused:
        await ops.replay(iid, "a")
    assert str(refused.value) == (
        f"instance {iid} runs 'rph' v1 with plan {ran_v1.plan.plan_hash[:12]}, which is not stored (v1 is stored "
        f"with plan {other_v1.plan.plan_hash[:12]}): its sensitive paths are unknown; register that plan's code "
        "to replay it; nothing was changed")
    after = await engine.client.get(iid)
    assert (after.status, after.updated_at) == (before.status, before.updated_at)


async def test_the_pinned_contract_is_the_instances_own_plan_only(engine: Engine) -> None:
    """The contract named other_v1's row (its plan hash and signals) as the version the instance runs."""
    iid = await _started_unregistered(engine)
    assert await engine.store.definitions.pinned_contract(iid) is None


async def test_an_unknown_signal_does_not_name_another_plans_signals(engine: Engine) -> None:
    iid = await _started_unregistered(engine)
    with pytest.raises(UnknownSignal) as refused:
        await engine.client.signal(iid, "nope", {})
    assert refused.value.declared == ()
