"""A signal and the step it enters commit as one (core.folding), on PostgreSQL: what they write is what
the two commits wrote, save the continuation command between them; a step that retries still commits
the signal first; a folded commit refused by a conflict folds again on fresh state."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from pydantic import BaseModel, Field

from stepstone import Registry, Retry, StepContext, Workflow
from stepstone.testing import Engine, open_engine
from tests.engine.conftest import Rows, kinds


class Log(BaseModel):
    log: list[str] = Field(default_factory=list)


ATTEMPTS: dict[str, int] = {}

signalled: Workflow[Log] = Workflow("folding_signalled", version=1, state=Log)
signalled.wait("parked", signals={"go": "work"}, timeout=timedelta(hours=1), on_timeout="work", start=True)


@signalled.step(next=None)
def work(ctx: StepContext, state: Log) -> None:
    assert ctx.signal is not None
    state.log.append(f"work:{ctx.signal.payload}")


retried: Workflow[Log] = Workflow("folding_retried", version=1, state=Log)
retried.wait("parked", signals={"go": "shaky"}, start=True)


@retried.step(next=None, retry=Retry(max_attempts=3, backoff=0.01))
def shaky(ctx: StepContext, state: Log) -> None:
    ATTEMPTS[ctx.instance_id] = ATTEMPTS.get(ctx.instance_id, 0) + 1
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails")
    state.log.append(f"shaky:{ctx.attempt}")


chain: Workflow[Log] = Workflow("folding_chain", version=1, state=Log)


@chain.step(start=True, next="second")
def first(_ctx: StepContext, _state: Log) -> None:
    """Changes nothing: its completion is as plain as a signal's transition, but a handler ran for it."""


@chain.step(next=None)
def second(_ctx: StepContext, state: Log) -> None:
    state.log.append("second")


BARRIER = threading.Barrier(2)
ARRIVED: set[str] = set()
RUNS: list[str] = []

gates: Workflow[Log] = Workflow("folding_gates", version=1, state=Log)
gates.fork("gates", branches={"g1": "gate", "g2": "gate"}, start=True)
gates.wait("gate", signals={"open": "passed"})


@gates.step(next="through")
def passed(ctx: StepContext, state: Log) -> None:
    assert ctx.branch is not None
    RUNS.append(ctx.branch.name)
    if ctx.branch.name not in ARRIVED:  # the first run of each: both read the same state before either commits
        ARRIVED.add(ctx.branch.name)
        with contextlib.suppress(threading.BrokenBarrierError):
            BARRIER.wait(timeout=10)
    state.log.append(ctx.branch.name)


gates.join("through", fork="gates", next="closed")


@gates.step(next=None)
def closed(_ctx: StepContext, state: Log) -> None:
    state.log.append("closed")


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, Registry(signalled, retried, gates, chain), concurrency=4,
                           lease_seconds=30) as e:
        yield e


async def test_a_signal_and_its_step_commit_once_and_write_what_two_commits_wrote(
    engine: Engine, rows: Rows
) -> None:
    iid = await engine.client.start(signalled, {})
    await engine.run_until_idle()
    commits = engine.worker.events.commits
    await engine.client.signal(iid, "go", "now")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["log"] == ["work:now"]
    assert engine.worker.events.commits == commits + 1  # the signal and the step: one commit
    history = await engine.client.history(iid)
    assert kinds(history)[-3:] == ["SIGNAL_APPLIED", "STEP_COMPLETED", "INSTANCE_COMPLETED"]
    signal_row = next(c for c in await rows.commands(iid) if c["kind"] == "SIGNAL")
    assert signal_row["state"] == "COMPLETE"
    # The history of both lands under the signal's command, in one commit; no STEP command between them.
    folded = await rows.conn.fetch(
        "SELECT kind, command_id, at FROM stepstone.history WHERE instance_id = $1::uuid AND seq > 2 ORDER BY seq",
        iid)
    assert {r["command_id"] for r in folded} == {signal_row["id"]} and len({r["at"] for r in folded}) == 1
    # The START ended in the wait with its timeout and became that timer (migration 0035).
    assert [c["kind"] for c in await rows.commands(iid)] == ["TIMER", "SIGNAL"]
    timer = next(c for c in await rows.commands(iid) if c["kind"] == "TIMER")
    assert timer["state"] == "SUPERSEDED"  # the wait's timeout closed in the same commit
    assert await rows.open_commands(iid) == []


async def test_a_step_that_retries_commits_the_signal_first_and_runs_once_per_attempt(
    engine: Engine, rows: Rows
) -> None:
    iid = await engine.client.start(retried, {})
    await engine.run_until_idle()
    await engine.client.signal(iid, "go")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    for _ in range(50):  # the retry is due 10 ms later
        if info.status == "COMPLETED":
            break
        await engine.run_until_idle()
        info = await engine.client.get(iid)
    assert info.status == "COMPLETED" and info.state["log"] == ["shaky:2"]
    assert ATTEMPTS.pop(iid) == 2  # the failed attempt's handler ran once: the signal's commit did not re-run it
    assert kinds(await engine.client.history(iid))[2:] == [
        "SIGNAL_APPLIED", "STEP_FAILED", "STEP_COMPLETED", "INSTANCE_COMPLETED"]
    step = [c for c in await rows.commands(iid) if c["kind"] == "STEP"]
    assert len(step) == 1 and step[0]["attempt"] == 2 and step[0]["state"] == "COMPLETE"


async def test_a_folded_commit_refused_by_a_conflict_folds_again_on_fresh_state(engine: Engine) -> None:
    ARRIVED.clear()
    RUNS.clear()
    iid = await engine.client.start(gates, {})
    await engine.run_until_idle()
    await engine.client.signal(iid, "open", 1, position="gates/g1")
    await engine.client.signal(iid, "open", 2, position="gates/g2")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED", info.error
    assert sorted(info.state["log"]) == ["closed", "g1", "g2"], "an update was lost"
    assert engine.worker.events.conflicts >= 1 and len(RUNS) == 3  # the refused one ran again
    history = await engine.client.history(iid)
    applied = sorted(h["position"] for h in history if h["kind"] == "SIGNAL_APPLIED")
    completed = sorted(h["position"] for h in history if h["kind"] == "STEP_COMPLETED" and h["step"] == "passed")
    assert applied == ["gates/g1", "gates/g2"] and completed == ["gates/g1", "gates/g2"]


async def test_a_steps_completion_never_folds_into_the_next_step(engine: Engine, rows: Rows) -> None:
    """Only a decision no handler ran for folds: a step's completion commits before the next step runs,
    so a crash in the next step never repeats this one."""
    iid = await engine.client.start(chain, {})
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).state["log"] == ["second"]
    done = await rows.conn.fetch(
        "SELECT step, at FROM stepstone.history WHERE instance_id = $1::uuid AND kind = 'STEP_COMPLETED' "
        "ORDER BY seq", iid)
    assert [r["step"] for r in done] == ["first", "second"]
    assert done[0]["at"] < done[1]["at"]  # two commits (one transaction writes one `at`): the first came first
