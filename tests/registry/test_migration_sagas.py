"""A saga that may still run (COMPENSATING, or COMPENSATION_FAILED until an operator retries it) is moved by a
migration like any other live instance: that is how a compensation fixed in a new version reaches it."""

from __future__ import annotations

from typing import Any

import pytest

from stepstone import CompensationContext, Registry, Retry, StepContext, Workflow
from stepstone.errors import InvalidTransition, MigrationRefused
from stepstone.ops import Operations
from stepstone.testing import Engine, open_engine


class Declined(Exception):
    pass


def _trip(version: int) -> Workflow[Any]:
    wf: Workflow[Any] = Workflow("ms_trip", version=version)

    @wf.step(start=True, next="pay")
    async def book(_ctx: StepContext, state: dict[str, Any]) -> None:
        state["booked"] = True

    @wf.compensation("book", retry=Retry(max_attempts=1))
    async def unbook(_ctx: CompensationContext, state: dict[str, Any], _recorded: Any) -> None:
        if version == 1:
            raise RuntimeError("v1's compensation is broken")
        state["unbooked"] = True

    @wf.step(next=None, retry=Retry(max_attempts=1))
    async def pay(_ctx: StepContext, _state: dict[str, Any]) -> None:
        raise Declined("card declined")

    return wf


trip_v1, trip_v2 = _trip(1), _trip(2)
renamed: Workflow[Any] = Workflow("ms_trip", version=3)  # v2 with `book` renamed `reserve`
undeclared: Workflow[Any] = Workflow("ms_trip", version=4)  # v2 with no compensation for `book`


@renamed.step(name="reserve", start=True, next="pay")
@undeclared.step(name="book", start=True, next="pay")
async def _book(_ctx: StepContext, state: dict[str, Any]) -> None:
    state["booked"] = True


@renamed.compensation("reserve")
async def _unbook(_ctx: CompensationContext, state: dict[str, Any], _recorded: Any) -> None:
    state["unbooked"] = True


@renamed.step(name="pay", next=None)
@undeclared.step(name="pay", next=None)
async def _pay(_ctx: StepContext, _state: dict[str, Any]) -> None:
    raise Declined("card declined")


async def _compensation_failed(engine: Engine) -> str:
    iid = await engine.client.start(trip_v1, {})
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPENSATION_FAILED"
    return iid


@pytest.fixture
async def engine(database_url: str) -> Any:
    async with open_engine(database_url, Registry(trip_v1, trip_v2, renamed, undeclared)) as e:
        yield e


async def test_a_batch_migration_moves_a_saga_whose_compensation_failed(engine: Engine) -> None:
    """The batch form (a definition and a from_version, as `stepstone definitions migrate --from-version`)
    took only PENDING, RUNNING, WAITING and FAILED instances: it answered nothing for this one, which kept
    v1's broken compensation, while naming it by id moved it."""
    iid = await _compensation_failed(engine)
    report = await engine.client.migrate(None, to=trip_v2, definition="ms_trip", from_version=1)
    assert [(o.instance_id, o.outcome) for o in report.outcomes] == [(iid, "migrated")]
    await engine.client.retry(iid)
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.version, info.state) == ("COMPENSATED", 2, {"booked": True, "unbooked": True})


async def test_a_saga_whose_compensation_failed_holds_back_its_versions_retirement(engine: Engine) -> None:
    """An operator's retry runs its compensation again on the version it pins, as a FAILED instance's retry
    runs its step: retiring that version was allowed (live pins counted FAILED and COMPENSATING only)."""
    iid = await _compensation_failed(engine)
    definitions = engine.store.definitions
    await definitions.activate("default", "ms_trip", 2)
    await definitions.transition("default", "ms_trip", 1, "DEPRECATED")
    with pytest.raises(InvalidTransition, match="still pins 1 instance"):
        await definitions.transition("default", "ms_trip", 1, "RETIRED")
    await engine.client.migrate(iid, to=trip_v2)
    assert await definitions.transition("default", "ms_trip", 1, "RETIRED") == "DEPRECATED"


undo_slowly: Workflow[Any] = Workflow("ms_undo", version=1)


@undo_slowly.step(start=True, next="fail")
async def take(_ctx: StepContext, state: dict[str, Any]) -> None:
    state["taken"] = True


@undo_slowly.compensation("take", retry=Retry(max_attempts=3, backoff=600))
async def give_back(_ctx: CompensationContext, _state: dict[str, Any], _recorded: Any) -> None:
    raise RuntimeError("the undo service is down")  # retried in 10 minutes: the saga stays COMPENSATING


@undo_slowly.step(next=None, retry=Retry(max_attempts=1))
async def fail(_ctx: StepContext, _state: dict[str, Any]) -> None:
    raise Declined("no")


async def test_a_compensating_saga_no_worker_serves_is_reported_stranded(database_url: str) -> None:
    """A COMPENSATING saga runs its compensations on the workers that serve its version, by itself; with
    none serving it, it waits there as a waiting instance does, but the stranded report (and doctor's)
    counted PENDING, RUNNING and WAITING instances only."""
    async with open_engine(database_url, Registry(undo_slowly)) as engine:
        iid = await engine.client.start(undo_slowly, {})
        await engine.run_until_idle()
        assert (await engine.client.get(iid)).status == "COMPENSATING"
        stranded = await engine.store.definitions.stranded(60)  # no worker has sent a heartbeat
        assert [(s.pin.definition_id, s.instances) for s in stranded] == [("ms_undo", 1)]


async def test_a_step_with_a_compensation_owed_keeps_its_name_and_its_compensation(engine: Engine) -> None:
    """A saga's completed step is remembered, for its compensation, by its name (`compensations`). Migrated
    with that step renamed, or to a version that declares no compensation on it, the saga retried gave up
    at once ("UnknownCompensation: the pinned plan declares no compensation on 'book'"), for good: refused."""
    iid = await _compensation_failed(engine)
    with pytest.raises(MigrationRefused, match=r"step 'book' completed with its compensation owed: it keeps its "
                                               r"name \('reserve' given\)"):
        await engine.client.migrate(iid, to=renamed, step_map={"book": "reserve"})
    with pytest.raises(MigrationRefused, match=r"step 'book' completed with its compensation owed, which v4 does "
                                               r"not declare"):
        await engine.client.migrate(iid, to=undeclared)
    assert (await engine.client.get(iid)).version == 1


async def test_a_bulk_cancel_that_leaves_a_saga_compensating_says_why(engine: Engine) -> None:
    """`repair cancel --compensate` (and the API's bulk cancel) of a saga that compensates already, or whose
    compensation stopped, leaves it as it is: the reason said "it had already ended (COMPENSATION_FAILED)",
    which it had not; `stepstone cancel --compensate` said what to do instead. Both say the same now."""
    iid = await _compensation_failed(engine)
    report = await Operations.on(engine.store).cancel([iid], compensate=True)
    [item] = report.items
    assert (item.ok, item.outcome, item.status) == (False, "unchanged", "COMPENSATION_FAILED")
    assert item.reason == ("its compensation stopped; nothing changed (`stepstone retry` resumes it, `stepstone "
                           "cancel` without --compensate gives up)")
