"""The schema functions read the plan an instance is pinned to by its plan hash (migration 0080).

An id the registry has never seen is admitted (an engine used without registration), so an instance can run a
plan that is not stored while its version is stored later with other code (another plan hash; docs/versions.md).
The signal check, an operator's retry (step deadlines) and a child's report (its redaction) read that other
code's row as the instance's plan. Set-up as tests/registry/test_reads_by_plan_hash.py.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Annotated, Any

import asyncpg
import pytest
from pydantic import BaseModel

from stepstone.authoring.sensitive import Sensitive
from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.core.pin import pin_of
from stepstone.core.redaction import REDACTED
from stepstone.errors import UnknownSignal
from stepstone.ops import Operations
from stepstone.store.port import NewInstance
from stepstone.testing import Engine, open_engine


class Secretive(BaseModel):
    secret: Annotated[str, Sensitive]
    note: str = ""


class Plain(BaseModel):
    secret: str = ""
    note: str = ""


# What the instance runs: `secret` is sensitive, `a` has no deadline, `hold` takes `go`.
ran_v1: Workflow[Any] = Workflow("sph", version=1, state=Secretive)
ran_v1.wait("hold", signals={"go": "$end"})
# Other code registered as v1 later (another plan hash): nothing sensitive, `a` has a deadline, `hold` takes
# `poke` too.
other_v1: Workflow[Any] = Workflow("sph", version=1, state=Plain)
other_v1.wait("hold", signals={"go": "$end", "poke": "$end"})


@ran_v1.step(name="a", start=True, next="hold")
async def a(_ctx: StepContext, _state: Any) -> None:
    pass


@other_v1.step(name="a", start=True, next="hold", deadline=timedelta(minutes=5))
async def other_a(_ctx: StepContext, _state: Any) -> None:
    pass


parent: Workflow[Any] = Workflow("sph_parent", version=1)
parent.wait("hold", signals={"go": "$end"}, start=True)

STATE = {"secret": "s3cr3t-canary", "note": "a note"}


@pytest.fixture
async def engine(database_url: str) -> Any:
    async with open_engine(database_url, Registry(parent)) as e:
        yield e


async def _started_unregistered(engine: Engine, step: str = "a") -> str:
    """An instance of ran_v1 started by an engine that never registered it (admitted: the id is new); then
    other code is registered as v1."""
    iid = str(uuid.uuid4())
    await engine.store.start(NewInstance(iid, pin_of(ran_v1), dict(STATE), step, None, None, None))
    await engine.store.register(pin_of(other_v1), other_v1.registration_document())
    return iid


async def test_a_signal_only_another_plan_declares_is_refused(engine: Engine) -> None:
    """`poke` is declared by other_v1 only: it was recorded for an instance that runs ran_v1."""
    iid = await _started_unregistered(engine, "hold")
    with pytest.raises(UnknownSignal):
        await engine.client.signal(iid, "poke", {})


async def test_a_signal_to_an_instance_whose_plan_is_stored_is_checked_by_it(engine: Engine) -> None:
    await engine.store.register(pin_of(ran_v1), ran_v1.registration_document())
    iid = str(uuid.uuid4())
    await engine.store.start(NewInstance(iid, pin_of(ran_v1), dict(STATE), "hold", None, None, None))
    assert await engine.client.signal(iid, "go", {}) > 0
    with pytest.raises(UnknownSignal):
        await engine.client.signal(iid, "poke", {})


async def test_a_retry_does_not_bound_a_step_by_another_plans_deadline(
    engine: Engine, conn: asyncpg.Connection
) -> None:
    """other_v1's `a` has a 5-minute deadline; ran_v1's has none: the retry queued other_v1's timer."""
    iid = await _started_unregistered(engine)
    await conn.execute("UPDATE stepstone.positions SET status = 'FAILED' WHERE instance_id = $1", iid)
    await conn.execute("UPDATE stepstone.instances SET status = 'FAILED' WHERE id = $1", iid)
    assert (await Operations.on(engine.store).retry([iid])).succeeded == 1
    assert await conn.fetch("SELECT id FROM stepstone.commands WHERE instance_id = $1 AND kind = 'TIMER' "
                            "AND name = 'step_deadline'", iid) == []


async def test_a_childs_report_is_redacted_by_every_stored_plans_paths_when_its_own_is_not_stored(
    engine: Engine, conn: asyncpg.Connection
) -> None:
    """A child step run again (an operator's retry) reports a completed child to its parent: its state was
    redacted by other_v1's paths (none), so the parent's command carried the secret ran_v1 marks. Its own paths
    are unknown: it is redacted by every path a stored plan of its workflow marks (ran_v1 as v2 here)."""
    v2: Workflow[Any] = Workflow("sph", version=2, state=Secretive)
    v2.step(a, name="a", start=True, next=None)
    pid = await engine.client.start(parent, {})
    child = await _started_unregistered(engine)
    await engine.store.register(pin_of(v2), v2.registration_document())
    await conn.execute("UPDATE stepstone.instances SET parent_id = $1, parent_position = '', parent_visit = 1, "
                       "status = 'COMPLETED', ended_at = now() WHERE id = $2", uuid.UUID(pid), child)
    await conn.execute("SELECT stepstone.start_children($1, '', 1, $2::jsonb, now(), 'test')", uuid.UUID(pid),
                       json.dumps([{"id": child}]))
    payload = await conn.fetchval("SELECT payload FROM stepstone.commands WHERE instance_id = $1 "
                                  "AND kind = 'CHILD_COMPLETION'", uuid.UUID(pid))
    assert json.loads(payload)["state"] == {"secret": REDACTED, "note": "a note"}


timed: Workflow[Any] = Workflow("sph_timed", version=1)


@timed.step(name="a", start=True, next=None, deadline=timedelta(minutes=5))
async def timed_a(_ctx: StepContext, _state: Any) -> None:
    pass


async def test_a_retry_bounds_a_step_by_its_own_plan_registered_in_its_own_scope_after_it_started(
    engine: Engine, conn: asyncpg.Connection
) -> None:
    """Started in scope acme before any registration (its definition scope stays 'default'), then its own code
    is registered in acme: the retry finds its plan there (one timer, though the plan is looked for in both)."""
    iid = str(uuid.uuid4())
    await engine.store.start(NewInstance(iid, pin_of(timed, "acme"), {}, "a", None, None, None))
    await engine.store.register(pin_of(timed, "acme"), timed.registration_document())
    await conn.execute("UPDATE stepstone.positions SET status = 'FAILED' WHERE instance_id = $1", iid)
    await conn.execute("UPDATE stepstone.instances SET status = 'FAILED' WHERE id = $1", iid)
    assert (await Operations.on(engine.store).retry([iid])).succeeded == 1
    timers = await conn.fetch("SELECT available_at - created_at AS bound FROM stepstone.commands WHERE "
                              "instance_id = $1 AND kind = 'TIMER' AND name = 'step_deadline'", iid)
    assert [t["bound"] for t in timers] == [timedelta(minutes=5)]
