"""A continuation from a step's own command goes on in that command's row (migration 0030), on PostgreSQL:
a run of steps is one command row; what arrived from outside (a signal) stays settled as its own
record; a row whose payload the commit redacts is settled, not taken over; and a commit document of
an earlier worker, with the continuation among its commands, is carried out as before."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, Field

from stepstone import Registry, Retry, StepContext, Workflow
from stepstone.authoring.sensitive import Sensitive
from stepstone.core.effects import Enqueue, MovePosition
from stepstone.core.model import RUNNING, Decision, Settle
from stepstone.ops import Operations
from stepstone.store.effects import commit_document
from stepstone.store.port import Claim
from stepstone.testing import open_engine
from tests.engine.conftest import Rows


class Log(BaseModel):
    log: list[str] = Field(default_factory=list)


run: Workflow[Log] = Workflow("in_place_run", version=1, state=Log)


@run.step(start=True, next="two")
def one(_ctx: StepContext, state: Log) -> None:
    state.log.append("one")


@run.step(next="three")
def two(_ctx: StepContext, state: Log) -> None:
    state.log.append("two")


@run.step(next=None)
def three(_ctx: StepContext, state: Log) -> None:
    state.log.append("three")


after_signal: Workflow[Log] = Workflow("in_place_after_signal", version=1, state=Log)
after_signal.wait("parked", signals={"go": "first"}, start=True)


@after_signal.step(next="second")
def first(ctx: StepContext, state: Log) -> None:
    assert ctx.signal is not None
    state.log.append(f"first:{ctx.signal.payload['n']}")


@after_signal.step(next=None)
def second(_ctx: StepContext, state: Log) -> None:
    state.log.append("second")


class Code(BaseModel):
    code: Annotated[str, Sensitive]


redacted: Workflow[Log] = Workflow("in_place_redacted", version=1, state=Log)
redacted.wait("parked", signals={"code": "check"}, payloads={"code": Code}, start=True)


@redacted.step(next="done", retry=Retry(max_attempts=2, backoff=1))
def check(ctx: StepContext, state: Log) -> None:
    if ctx.attempt == 1:  # the step then runs on a STEP command of its own that carries the signal
        raise RuntimeError("not yet")
    state.log.append("checked")


@redacted.step(next=None)
def done(_ctx: StepContext, state: Log) -> None:
    state.log.append("done")


registry = Registry(run, after_signal, redacted)


async def _commands(rows: Rows, iid: str) -> list[dict[str, Any]]:
    return [dict(r) for r in await rows.commands(iid)]


def _on_to_two(claim: Claim, lease_seconds: float) -> dict[str, Any]:
    """The commit document of step one of `run` completing and going on to `two` under this claim."""
    moved, queued = MovePosition(RUNNING, "two", 2), Enqueue("STEP", "two", 2, continuation=True)
    decision = Decision(Settle("COMPLETE"), (moved, queued))
    return commit_document(decision, instance_id=claim.instance.id, position="", command_id=claim.command.id,
                           token=claim.token, visit=1, state_version=claim.instance.state_version,
                           version=claim.pin.version, lease_seconds=lease_seconds, worker="a-worker")


async def _commit(rows: Rows, doc: dict[str, Any]) -> Any:
    return await rows.conn.fetchrow("SELECT * FROM stepstone.commit_decision($1::jsonb)", json.dumps(doc))


async def test_a_run_of_steps_is_one_command_row(database_url: str, rows: Rows) -> None:
    async with open_engine(database_url, registry) as engine:
        iid = await engine.client.start(run, {})
        await engine.run_until_idle()
        assert (await engine.client.get(iid)).state["log"] == ["one", "two", "three"]
        [command] = await _commands(rows, iid)
        assert (command["kind"], command["step"], command["visit"]) == ("START", "three", 3)
        assert command["state"] == "COMPLETE"
        assert (command["attempt"], command["claims"]) == (1, 1)
        named = await rows.conn.fetch(
            "SELECT step, command_id FROM stepstone.history WHERE instance_id = $1::uuid AND kind = 'STEP_COMPLETED' "
            "ORDER BY seq", iid)
        assert [(r["step"], r["command_id"]) for r in named] == [(s, command["id"]) for s in ("one", "two", "three")]


async def test_a_signal_stays_settled_and_the_steps_after_it_get_a_row(database_url: str, rows: Rows) -> None:
    async with open_engine(database_url, registry) as engine:
        iid = await engine.client.start(after_signal, {})
        await engine.run_until_idle()
        await engine.client.signal(iid, "go", {"n": 7})
        await engine.run_until_idle()
        assert (await engine.client.get(iid)).state["log"] == ["first:7", "second"]
        found = [(c["kind"], c["step"], c["state"]) for c in await _commands(rows, iid)]
        assert found == [("START", "parked", "COMPLETE"), ("SIGNAL", None, "COMPLETE"), ("STEP", "second", "COMPLETE")]
        [signal] = [c for c in await _commands(rows, iid) if c["kind"] == "SIGNAL"]
        assert (signal["name"], json.loads(signal["payload"])) == ("go", {"n": 7})  # the record of what arrived


async def test_a_row_whose_payload_the_commit_redacts_is_settled_not_taken_over(database_url: str, rows: Rows) -> None:
    async with open_engine(database_url, registry) as engine:
        iid = await engine.client.start(redacted, {})
        await engine.run_until_idle()
        await engine.client.signal(iid, "code", {"code": "c-canary-5"})
        await engine.run_until_idle()  # check fails once: the transition commits with a STEP of its own
        await engine.move_clock(2)
        await engine.run_until_idle()  # the retry succeeds and goes on to done, redacting what it was given
        assert (await engine.client.get(iid)).state["log"] == ["checked", "done"]
        steps = {c["step"]: c for c in await _commands(rows, iid) if c["kind"] == "STEP"}
        assert set(steps) == {"check", "done"}
        assert steps["check"]["state"] == "COMPLETE" and "c-canary-5" not in steps["check"]["payload"]
        assert json.loads(steps["check"]["payload"])["signal"]["name"] == "code"
        assert steps["done"]["payload"] is None  # the next step's own command, not the redacted one


async def test_a_document_of_an_earlier_worker_is_carried_out_as_before(database_url: str, rows: Rows) -> None:
    """An earlier worker (a rolling deploy) sends the continuation among `commands`, without `next`."""
    async with open_engine(database_url, registry) as engine:
        ids = [await engine.client.start(run, {}) for _ in range(2)]
        claims = await engine.store.claim(2, 30, "a-worker")
        results = {}
        in_start_order = sorted(claims, key=lambda c: ids.index(c.instance.id))
        for claim, shape in zip(in_start_order, ("now", "earlier"), strict=True):
            doc = _on_to_two(claim, 30)
            if shape == "earlier":
                doc["commands"] = [doc.pop("next")]
            row = await _commit(rows, doc)
            assert row is not None and row["outcome"] == "ok"
            results[shape] = (claim.command.id, row["continuation"], await _commands(rows, claim.instance.id))
        claimed, went_on, commands = results["now"]
        assert went_on == claimed
        assert [(c["id"], c["step"], c["state"]) for c in commands] == [(claimed, "two", "CLAIMED")]
        claimed, went_on, commands = results["earlier"]
        assert went_on != claimed
        assert [(c["id"], c["step"], c["state"]) for c in commands] == [
            (claimed, "one", "COMPLETE"), (went_on, "two", "CLAIMED")]


async def test_the_lease_is_the_positions_after_a_continuation_in_place(database_url: str, rows: Rows) -> None:
    """The update leaves the command's expiry where the claim put it and moves the position's on: a claim,
    an idle worker's wake-up and the execution probe all go by the position's."""
    async with open_engine(database_url, registry) as engine:
        iid = await engine.client.start(run, {})
        [claim] = await engine.store.claim(1, 30, "a-worker")
        row = await _commit(rows, _on_to_two(claim, 300))
        assert row is not None and row["continuation"] == claim.command.id
        await engine.move_clock(31)  # past the command's expiry (the claim's 30 s), not the position's (300 s)
        assert await engine.store.claim(1, 30, "b-worker") == []
        upcoming = await engine.store.next_available()
        assert upcoming is not None and 260 < upcoming <= 270
        report = await Operations.on(engine.store).probe(iid)
        assert [c["id"] for c in report.in_flight] == [claim.command.id] and report.claimable == []
        await engine.move_clock(270)
        [taken] = await engine.store.claim(1, 30, "b-worker")
        assert (taken.command.id, taken.command.step, taken.command.claims) == (claim.command.id, "two", 2)
