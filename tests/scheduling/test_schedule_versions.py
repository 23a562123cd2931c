"""A schedule's tick starts the version a start of its workflow in the schedule's scope would get (the
scope's activation, else ...: `authoring.selection`), never merely the newest one the firing worker has;
a schedule a worker cannot fire is held without a poll loop and without losing its ticks
(docs/schedules.md, docs/versions.md)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from click.testing import CliRunner

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.cli import cli
from stepstone.errors import InvalidInput
from stepstone.runtime.scheduler import ScheduleFirer
from stepstone.runtime.worker import Worker
from stepstone.scheduling import Schedule
from stepstone.store.activation_inputs import inputs_refused
from stepstone.testing import Engine, open_engine
from tests.scheduling.workflows import New, Old, typed


def ticker(version: int, workflow_id: str = "ticker") -> Workflow[Any]:
    wf: Workflow[Any] = Workflow(workflow_id, version=version)

    @wf.step(start=True, next=None)
    def record(ctx: StepContext, state: dict[str, Any]) -> None:
        state["ran_version"] = version

    return wf


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    # v1 is recorded first, so it is the default scope's current version; v2 waits for an activation
    async with open_engine(database_url, Registry(ticker(1), ticker(2), ticker(1, "other"))) as e:
        yield e


async def _started(db: asyncpg.Connection) -> list[tuple[int, Any]]:
    """(version, state) of every ticker instance, oldest first."""
    rows = await db.fetch("SELECT version, state FROM stepstone.instances WHERE definition_id = 'ticker' "
                          "ORDER BY created_at, id")
    return [(r["version"], r["state"]) for r in rows]


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "stepstone.scheduler" and text in r.getMessage()]


async def test_a_tick_starts_the_current_version_not_the_newest_registered(
    engine: Engine, db: asyncpg.Connection,
) -> None:
    await engine.client.schedule(Schedule("s", "ticker", every=60))
    await engine.advance(seconds=60)
    assert await _started(db) == [(1, {"ran_version": 1})]

    await engine.store.definitions.activate("default", "ticker", 2)
    await engine.advance(seconds=60)
    assert await _started(db) == [(1, {"ran_version": 1}), (2, {"ran_version": 2})]
    assert (await engine.client.schedules())[0].fired == 2


async def test_a_worker_lacking_the_selected_version_leaves_the_schedule_and_does_not_spin(
    engine: Engine, db: asyncpg.Connection, caplog: pytest.LogCaptureFixture,
) -> None:
    await engine.client.schedule(Schedule("s", "ticker", every=60))
    await engine.store.definitions.activate("default", "ticker", 2)
    await engine.move_clock(90)
    old = Worker(engine.store, Registry(ticker(1)))  # a rolling deploy: this one has v1 only
    assert old.schedules is not None
    caplog.set_level(logging.INFO, logger="stepstone.scheduler")
    for _ in range(3):
        assert await old.schedules.fire_due() == 0
        assert old.schedules.held == {"s"}
        gap = await old.schedules.next_tick()
        assert gap is None  # not "due now": its loop waits its interval, it does not poll the held schedule
    assert await _started(db) == []  # not fired with v1
    [told] = _lines(caplog, "schedule s:")  # said once, not at every round
    assert "'ticker' v2" in told.getMessage() and "left to the workers that have it" in told.getMessage()

    await engine.run_until_idle()  # a worker that has v2 fires the kept tick
    assert await _started(db) == [(2, {"ran_version": 2})]
    assert await old.schedules.fire_due() == 0
    assert old.schedules.held == frozenset()
    gap = await old.schedules.next_tick()
    assert gap is not None and 0 < gap <= 60  # its next tick is waited for again


async def test_no_admissible_version_keeps_the_ticks_with_one_error_line_then_catches_up(
    engine: Engine, db: asyncpg.Connection, caplog: pytest.LogCaptureFixture,
) -> None:
    await engine.client.schedule(Schedule("s", "ticker", every=60))
    await engine.store.definitions.deactivate("default", "ticker")
    for version in (1, 2):
        await engine.store.definitions.transition("default", "ticker", version, "DEPRECATED")
    caplog.set_level(logging.INFO, logger="stepstone.scheduler")
    await engine.move_clock(90)
    await engine.run_until_idle()
    await engine.run_until_idle()
    assert await _started(db) == []
    [told] = _lines(caplog, "schedule s:")  # one line for the tick, not one per round
    assert told.levelno == logging.ERROR and told.exc_info is None
    assert "no version of workflow 'ticker' takes new instances in scope default" in told.getMessage()
    assert "stepstone definitions reinstate ticker" in told.getMessage()
    await engine.advance(minutes=3)  # would give up after 10,000 stops if the held schedule were "due now"
    assert await _started(db) == []
    assert len(_lines(caplog, "schedule s:")) == 2  # later ticks came due, still held: one more line
    [info] = await engine.client.schedules()
    assert info.fired == 0 and info.next_fire_at < await engine.store.db_now()  # the ticks are kept

    await engine.store.definitions.transition("default", "ticker", 2, "AVAILABLE")
    await engine.run_until_idle()
    assert await _started(db) == [(2, {"ran_version": 2})]  # catch_up="one": the latest missed tick
    [info] = await engine.client.schedules()
    assert info.fired == 1 and info.next_fire_at > await engine.store.db_now()


async def test_a_version_deprecated_after_its_selection_holds_that_schedule_only(
    engine: Engine, db: asyncpg.Connection, caplog: pytest.LogCaptureFixture,
) -> None:
    """The pin admission of the firing statement refuses it; the other schedules of the round still fire."""
    stale = ticker(2)

    class SelectedBeforeTheDeprecation:
        async def select_version(self, scope: str, definition_id: str) -> tuple[str, int, str] | None:
            if definition_id == "ticker":
                return "default", 2, stale.plan.plan_hash
            return await engine.store.definitions.select_version(scope, definition_id)

    await engine.client.schedule(Schedule("s", "ticker", every=60))
    await engine.client.schedule(Schedule("t", "other", every=60))
    await engine.store.definitions.transition("default", "ticker", 2, "DEPRECATED")
    await engine.move_clock(90)
    firer = ScheduleFirer(engine.store, engine.worker.registry, SelectedBeforeTheDeprecation())
    caplog.set_level(logging.INFO, logger="stepstone.scheduler")
    assert await firer.fire_due() == 1  # "t"
    assert firer.held == {"s"}
    [told] = _lines(caplog, "schedule s:")
    assert told.levelno == logging.WARNING and "DEPRECATED" in told.getMessage()
    assert await _started(db) == []  # nothing of "s" was written

    await engine.run_until_idle()  # selected afresh: v1, the current version
    assert await _started(db) == [(1, {"ran_version": 1})]


async def test_a_schedules_input_is_checked_against_the_version_its_ticks_start(database_url: str) -> None:
    """The input was checked against the newest registered version (v2 here), though the ticks start the
    version the scope selects (v1, recorded first): an input for v1 was refused, and one for v2 was
    accepted and then skipped at every tick."""
    async with open_engine(database_url, Registry(typed(1, Old), typed(2, New))) as engine:
        info = await engine.client.schedule(Schedule("t", "typed", every=60, input={"a": 1}))
        assert info.input == {"a": 1}
        with pytest.raises(InvalidInput, match="schedule input"):
            await engine.client.schedule(Schedule("t", "typed", every=60, input={"b": 1}))
        await engine.store.definitions.activate("default", "typed", 2)  # now the ticks start v2
        assert (await engine.client.schedule(Schedule("t", "typed", every=60, input={"b": 2}))).input == {"b": 2}


async def test_a_schedule_starts_its_instances_in_its_scope(engine: Engine, db: asyncpg.Connection) -> None:
    """put_schedule stored every schedule in the default scope, whatever the caller meant."""
    info = await engine.client.schedule(Schedule("s", "ticker", every=60, scope="acme"))
    assert info.scope == "acme"
    await engine.advance(seconds=60)
    triggered = await engine.client.trigger_schedule("s")
    scopes = await db.fetch("SELECT id::text, scope FROM stepstone.instances WHERE definition_id = 'ticker'")
    assert sorted(r["scope"] for r in scopes) == ["acme", "acme"] and triggered in {r["id"] for r in scopes}


async def test_activating_a_version_names_the_schedules_whose_input_it_refuses(database_url: str) -> None:
    """A schedule's input is checked against the version its ticks start when it is declared; activating
    another version checked nothing, so a schedule whose input that version refuses had every tick skipped
    (an error in some worker's log) with nothing said at the activation. Now the activation names it."""
    async with open_engine(database_url, Registry(typed(1, Old), typed(2, New))) as engine:
        await engine.client.schedule(Schedule("t", "typed", every=60, input={"a": 1}))
        await engine.store.definitions.activate("acme", "typed", 1, target_scope="default")  # acme keeps v1
        await engine.client.schedule(Schedule("kept", "typed", every=60, input={"a": 2}, scope="acme"))
        args = ["--database-url", database_url, "definitions", "activate", "typed", "2"]
        text = await asyncio.to_thread(CliRunner().invoke, cli, args, catch_exceptions=False)
        assert text.exit_code == 0, text.output
        assert text.stdout.strip() == "scope default: typed v2 is current"
        [warning] = text.stderr.strip().splitlines()
        assert warning.startswith("warning: schedule t (scope default) starts typed v2 now"), warning
        assert "every tick will be skipped" in warning
        as_json = await asyncio.to_thread(CliRunner().invoke, cli, [*args, "-o", "json"], catch_exceptions=False)
        [refused] = json.loads(as_json.stdout)["schedules_refused"]
        assert (refused["name"], refused["scope"]) == ("t", "default") and refused["problem"].startswith("input")
        schedules = await engine.store.list_schedules()
        assert await inputs_refused(schedules, engine.store.definitions, "typed", 1) == []  # no ticks start v1
        # Declared again with an input v2 takes, nothing is refused
        await engine.client.schedule(Schedule("t", "typed", every=60, input={"b": 1}))
        assert await inputs_refused(await engine.store.list_schedules(), engine.store.definitions, "typed", 2) == []


async def test_the_refused_inputs_are_found_with_a_read_per_scope_not_per_schedule(database_url: str) -> None:
    """inputs_refused asked the registry for the selected version and its schema once per schedule."""
    async with open_engine(database_url, Registry(typed(1, Old), typed(2, New))) as engine:
        for n in range(5):
            await engine.client.schedule(Schedule(f"t{n}", "typed", every=60, input={"a": n}))
        await engine.client.schedule(Schedule("beta", "typed", every=60, input={"a": 9}, scope="beta"))
        await engine.client.schedule(Schedule("o", "ticker", every=60))
        await engine.store.definitions.activate("default", "typed", 2)
        asked: list[str] = []
        registry = engine.store.definitions

        class Counting:
            async def select_version(self, scope: str, definition_id: str) -> tuple[str, int, str] | None:
                asked.append(f"select {scope}")
                return await registry.select_version(scope, definition_id)

            async def find(self, scope: str, definition_id: str, version: int) -> dict[str, Any]:
                asked.append(f"find {scope}")
                return await registry.find(scope, definition_id, version)

        refused = await inputs_refused(await engine.store.list_schedules(), Counting(), "typed", 2)
        assert sorted(r.name for r in refused) == ["beta", "t0", "t1", "t2", "t3", "t4"]
        assert sorted(asked) == ["find default", "select beta", "select default"]
