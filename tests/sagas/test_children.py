"""A child workflow the saga completed is compensated by compensating the child: its own
compensations run (in its own reverse order), and the parent goes on once the child reports."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import asyncpg
import pytest
from click.testing import CliRunner

from stepstone.authoring.workflow import Registry
from stepstone.cli import cli
from stepstone.core.transitions import child_id
from stepstone.errors import InvalidState
from stepstone.testing import Engine, open_engine
from tests.sagas import workflows as w
from tests.sagas.conftest import ALERTS, kinds


async def test_a_completed_child_is_compensated_by_compensating_it(engine: Engine) -> None:
    iid = await engine.client.start(w.trip, {})
    await engine.run_until_idle()

    info = await engine.client.get(iid)
    assert info.status == "COMPENSATED"
    [child] = info.children
    assert child["status"] == "COMPENSATED"
    assert [c for _, c in w.CALLS] == ["leg_book", "outbound"]
    assert w.CALLS[0][0] == child["id"]
    assert (await engine.client.get(child["id"])).state["undone"] == ["leg_book:seat-7"]
    history = await engine.client.history(iid)
    k = kinds(history)
    assert k.index("CHILD_COMPENSATING") < k.index("STEP_COMPENSATED")
    assert [h["step"] for h in history if h["kind"] == "STEP_COMPENSATED"] == ["sub", "outbound"]
    assert "INSTANCE_COMPENSATED" in kinds(await engine.client.history(child["id"]))


async def test_a_child_that_cannot_compensate_stops_the_parent_until_retried(engine: Engine) -> None:
    iid = await engine.client.start(w.trip, {})
    cid = child_id(iid, "", "sub", 2)  # the child step's visit: outbound is visit 1
    w.FAIL[(cid, "undo_leg_book")] = -1
    await engine.run_until_idle()

    assert (await engine.client.get(cid)).status == "COMPENSATION_FAILED"
    info = await engine.client.get(iid)
    assert info.status == "COMPENSATION_FAILED"
    assert info.error["error"]["type"] == "ChildCompensationFailed"
    assert [a["instance_id"] for a in ALERTS] == [cid, iid]  # the child's alert, then the parent's
    assert [c for _, c in w.CALLS] == ["leg_book"] * 3  # the child's policy: three attempts; outbound waits

    w.FAIL.pop((cid, "undo_leg_book"))
    await engine.client.retry(iid)  # the parent's retry resumes the child's compensation too
    await engine.run_until_idle()
    assert (await engine.client.get(cid)).status == "COMPENSATED"
    assert (await engine.client.get(iid)).status == "COMPENSATED"
    assert [c for _, c in w.CALLS] == ["leg_book"] * 4 + ["outbound"]


async def test_a_child_that_cannot_compensate_again_after_the_parents_retry_stops_the_parent_again(
    engine: Engine, conn: asyncpg.Connection
) -> None:
    """The parent's retry resumes the child's compensation, which gives up again: the parent stops again,
    with its alert and its event raised again. Its commit of the child's report crashed instead: the
    event's id, named by the saga position's visit (1 for every command there), was the first round's, so
    its insert broke the outbox's unique event id; the segment crashed on every claim."""
    iid = await engine.client.start(w.trip, {})
    cid = child_id(iid, "", "sub", 2)
    w.FAIL[(cid, "undo_leg_book")] = -1
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPENSATION_FAILED"

    await engine.client.retry(iid)
    await engine.run_until_idle()
    assert (await engine.client.get(cid)).status == "COMPENSATION_FAILED"
    assert (await engine.client.get(iid)).status == "COMPENSATION_FAILED"
    assert engine.worker.events.crashed == 0
    assert [a["instance_id"] for a in ALERTS] == [cid, iid, cid, iid]
    events = await conn.fetch("SELECT instance_id, event_id FROM stepstone.outbox WHERE type = "
                              "'stepstone.compensation_failed' ORDER BY id")
    assert [str(e["instance_id"]) for e in events] == [cid, iid, cid, iid]
    assert len({e["event_id"] for e in events}) == 4

    w.FAIL.pop((cid, "undo_leg_book"))
    await engine.client.retry(iid)
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPENSATED"


def _compensated_in_order(*histories: list[dict[str, Any]]) -> list[str]:
    """Every STEP_COMPENSATED of these instances, in the order they committed (each is its own commit)."""
    done = [h for history in histories for h in history if h["kind"] == "STEP_COMPENSATED"]
    assert len({h["at"] for h in done}) == len(done), done  # distinct commits: the order is the clock's
    return [h["step"] for h in sorted(done, key=lambda h: h["at"])]


async def test_branches_and_a_completed_child_compensate_in_one_reverse_order(engine: Engine) -> None:
    iid = await engine.client.start(w.family, {})
    await engine.run_until_idle()  # home, then side completes; the child waits for "go"
    [child] = (await engine.client.get(iid)).children
    await engine.client.signal(child["id"], "go")
    await engine.run_until_idle()  # the child completes pair_one, pair_two; settle fails

    info = await engine.client.get(iid)
    assert info.status == "COMPENSATED"
    assert (await engine.client.get(child["id"])).status == "COMPENSATED"
    parent_history, child_history = await engine.client.history(iid), await engine.client.history(child["id"])
    # Completed: home, side, then kid (its pair_one, pair_two); undone in exactly the reverse order.
    assert _compensated_in_order(parent_history, child_history) == ["pair_two", "pair_one", "kid", "side", "home"]
    assert [c for _, c in w.CALLS] == ["pair_two", "pair_one", "side", "home"]
    assert (await engine.client.get(child["id"])).state["undone"] == ["pair_two:p2", "pair_one:p1"]
    k = kinds(parent_history)
    assert k.index("CHILD_COMPENSATING") < k.index("INSTANCE_COMPENSATED")


async def test_a_running_child_is_cancelled_with_compensation_before_the_parent_goes_on(
    engine: Engine, conn: asyncpg.Connection
) -> None:
    w.CHILD_BUSY.update(busy=asyncio.Event(), release=asyncio.Event())
    iid = await engine.client.start(w.parent, {})
    held = asyncio.create_task(engine.run_until_idle())
    await w.CHILD_BUSY["busy"].wait()  # the child's busy_work runs; then side completes, give_up fails

    assert (await engine.client.wait_for(iid, timeout=30)).status == "COMPENSATED"
    [child] = (await engine.client.get(iid)).children
    cid = child["id"]
    assert child["status"] == "COMPENSATED"  # not CANCELLED: its completed step was undone
    child_before = await conn.fetch("SELECT * FROM stepstone.history WHERE instance_id = $1 ORDER BY seq", cid)

    w.CHILD_BUSY["release"].set()  # the child's handler, fenced out when its parent compensated, wakes
    await held
    assert engine.worker.events.fenced == 1
    assert await conn.fetch("SELECT * FROM stepstone.history WHERE instance_id = $1 ORDER BY seq", cid) == child_before
    child_info = await engine.client.get(cid)
    assert "busy_work" not in child_info.state["log"]
    assert child_info.state["undone"] == ["busy_one:b1"]

    parent_history, child_history = await engine.client.history(iid), await engine.client.history(cid)
    # The open child counts as the newest: it is undone first, and the parent waits until it reports.
    assert _compensated_in_order(parent_history, child_history) == ["busy_one", "kid", "side", "home"]
    assert [c for _, c in w.CALLS] == ["busy_one", "side", "home"]
    assert kinds(child_history)[-1] == "INSTANCE_COMPENSATED"
    assert "INSTANCE_CANCELLED" not in kinds(child_history)


async def test_a_child_replayed_while_its_parents_saga_stopped_on_it_is_compensated_by_the_parents_retry(
    engine: Engine, conn: asyncpg.Connection
) -> None:
    """The replay of a child its parent's saga could not compensate ends the child's saga, link to the
    parent's saga (`saga.record`) included, as any new saga round sets it afresh: the child goes forward
    as an instance of its own, and its end does not move the stopped parent (CALLBACK_IGNORED). The
    parent's retry links it again: the child, completed once more, is compensated, both of its runs."""
    iid = await engine.client.start(w.trip, {})
    cid = child_id(iid, "", "sub", 2)
    w.FAIL[(cid, "undo_leg_book")] = -1
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPENSATION_FAILED"
    assert await conn.fetchval("SELECT saga ? 'record' FROM stepstone.instances WHERE id = $1", cid)

    w.FAIL.pop((cid, "undo_leg_book"))
    await engine.client.replay(cid, "leg_book")
    assert await conn.fetchval("SELECT saga FROM stepstone.instances WHERE id = $1", cid) is None
    await engine.run_until_idle()
    assert (await engine.client.get(cid)).status == "COMPLETED"
    assert (await engine.client.get(iid)).status == "COMPENSATION_FAILED"
    assert kinds(await engine.client.history(iid))[-1] == "CALLBACK_IGNORED"

    await engine.client.retry(iid)
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPENSATED"
    child = await engine.client.get(cid)
    assert child.status == "COMPENSATED" and child.state["undone"] == ["leg_book:seat-7", "leg_book:seat-7"]


async def _parent_replayed_forward(engine: Engine) -> tuple[str, str]:
    """A tour whose child could not compensate, stopping the parent too; the parent then replayed from its
    last step, which now succeeds: the parent COMPLETED, the child still COMPENSATION_FAILED."""
    iid = await engine.client.start(w.tour, {})
    cid = child_id(iid, "", "sub", 2)
    w.FAIL[(cid, "undo_leg_book")] = -1
    w.FAIL[(iid, "settle")] = -1
    await engine.run_until_idle()
    assert (await engine.client.get(cid)).status == "COMPENSATION_FAILED"
    assert (await engine.client.get(iid)).status == "COMPENSATION_FAILED"

    w.FAIL.pop((iid, "settle"))
    await engine.client.replay(iid, "settle")
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).status == "COMPLETED"
    assert (await engine.client.get(cid)).status == "COMPENSATION_FAILED"
    w.FAIL.pop((cid, "undo_leg_book"))
    return iid, cid


async def test_a_child_whose_parent_was_replayed_forward_is_not_undone_by_its_retry(
    engine: Engine, database_url: str
) -> None:
    """The parent went forward and COMPLETED counting on its child's work: a retry of the child, which
    would go on undoing it under that parent, is refused and names the parent (the client, the CLI and a
    bulk repair alike); nothing changes. Replaying the child takes it forward too."""
    iid, cid = await _parent_replayed_forward(engine)
    child_before = await engine.client.history(cid)
    calls = list(w.CALLS)

    with pytest.raises(InvalidState) as refused:
        await engine.client.retry(cid)
    assert str(refused.value) == (
        f"instance {cid} is not retried: its parent {iid} asked it to compensate, then went forward (replayed; it "
        "is COMPLETED), and a retry would undo this child under it. Replay the child to take it forward too, or "
        "cancel it to leave it as it is")
    said = await asyncio.to_thread(
        CliRunner().invoke, cli, ["retry", "--database-url", database_url, cid], catch_exceptions=False)
    assert (said.exit_code, said.stdout) == (1, ""), said.output
    assert said.stderr.strip() == f"error: {refused.value}"
    bulk = await asyncio.to_thread(
        CliRunner().invoke, cli, ["--database-url", database_url, "repair", "retry", cid, "-o", "json"])
    assert bulk.exit_code == 4, bulk.output
    [item] = json.loads(bulk.stdout)["items"]
    assert (item["ok"], item["outcome"], item["reason"]) == (False, "parent_went_on", str(refused.value))
    await engine.run_until_idle()
    assert (await engine.client.get(cid)).status == "COMPENSATION_FAILED"
    assert await engine.client.history(cid) == child_before
    assert calls == w.CALLS

    await engine.client.replay(cid, "leg_book")  # the way forward, as its parent went
    await engine.run_until_idle()
    assert (await engine.client.get(cid)).status == "COMPLETED"
    assert (await engine.client.get(iid)).status == "COMPLETED"
    assert calls == w.CALLS


async def test_a_later_round_of_the_replayed_parents_saga_asks_the_child_again(
    engine: Engine, conn: asyncpg.Connection
) -> None:
    """The link a replay settled is made again by the next round of the parent's saga, which resumes the
    child's compensation (given up, so owed) and then goes on; the child's mark is gone."""
    iid, cid = await _parent_replayed_forward(engine)
    assert await conn.fetchval("SELECT saga ? 'parent_replayed' AND NOT saga ? 'record' FROM stepstone.instances "
                               "WHERE id = $1", cid)
    w.FAIL[(iid, "settle")] = -1
    await engine.client.replay(iid, "settle")
    await engine.run_until_idle()
    assert (await engine.client.get(cid)).status == "COMPENSATED"
    assert (await engine.client.get(iid)).status == "COMPENSATED"
    assert [c for _, c in w.CALLS] == ["leg_book"] * 4 + ["outbound"]
    assert not await conn.fetchval("SELECT saga ? 'parent_replayed' FROM stepstone.instances WHERE id = $1", cid)


# A child that completed while its parent waited for it, whose report the parent had not applied yet when its
# saga began (a cancel with compensation, a deadline, another branch's failure): the saga settles that report
# unapplied, so the child is compensated as if its report had been applied just before (its completion is the
# parent's newest), never left COMPLETED under a parent that undid everything else. `policies` waits in two
# branches for a `pair` child each; the one in branch a completes on a worker that serves only `pair`, so its
# report waits at the parent.


async def _kid_completed_with_its_report_queued(engine: Engine, database_url: str, **start: Any) -> tuple[str, str]:
    iid = await engine.client.start(w.policies, {}, **start)
    await engine.run_until_idle()
    kid = next(str(c["id"]) for c in (await engine.client.get(iid)).children if c["position"] == "split/a")
    async with open_engine(database_url, Registry(w.pair), concurrency=2, lease_seconds=30) as pairs:
        await pairs.client.signal(kid, "go")
        await pairs.run_until_idle()
    assert (await engine.client.get(kid)).status == "COMPLETED"
    return iid, kid


async def _undone_with_its_kid(engine: Engine, iid: str, kid: str, status: str) -> None:
    info = await engine.client.get(iid)
    assert (info.status, info.state["undone"]) == (status, ["home:h"])
    assert (await engine.client.get(kid)).status == "COMPENSATED"
    assert (await engine.client.get(kid)).state["undone"] == ["pair_two:p2", "pair_one:p1"]
    assert [(i == kid, c) for i, c in w.CALLS] == [(True, "pair_two"), (True, "pair_one"), (False, "home")]
    history = await engine.client.history(iid)
    assert [h["step"] for h in history if h["kind"] == "STEP_COMPENSATED"] == ["kid", "home"]


async def test_a_child_whose_completion_report_waits_when_its_parent_is_cancelled_is_compensated(
    engine: Engine, database_url: str,
) -> None:
    iid, kid = await _kid_completed_with_its_report_queued(engine, database_url)
    assert await engine.client.cancel(iid, "stop", compensate=True) == "COMPENSATING"
    await engine.run_until_idle()
    await _undone_with_its_kid(engine, iid, kid, "CANCELLED")


async def test_a_deadline_fired_while_a_dead_worker_held_the_childs_report_compensates_the_child(
    engine: Engine, database_url: str,
) -> None:
    """The parent's worker claimed the child's report and died; the parent's deadline fires before its lease
    runs out."""
    iid, kid = await _kid_completed_with_its_report_queued(engine, database_url, deadline=60)
    [claim] = await engine.store.claim(1, 600, "dead-worker", [w.policies.id])
    assert claim.command.kind == "CHILD_COMPLETION"
    await engine.move_clock(seconds=61)
    await engine.run_until_idle()
    await _undone_with_its_kid(engine, iid, kid, "TIMED_OUT")


async def test_a_detached_child_that_completed_is_not_compensated_with_its_parent(engine: Engine) -> None:
    """A child started with cancel_with_parent=False is detached: its parent's compensation leaves it as it is,
    also once it completed and the parent went on with its result (docs/sagas.md, "Order, branches and
    children")."""
    iid = await engine.client.start(w.loosening, {})
    await engine.run_until_idle()
    [cid] = [str(c["id"]) for c in (await engine.client.get(iid)).children]
    w.FAIL[(iid, "settle")] = -1
    await engine.client.signal(cid, "go")
    await engine.run_until_idle()

    info = await engine.client.get(iid)
    assert (info.status, info.state["undone"]) == ("COMPENSATED", ["home:h"])
    assert (await engine.client.get(cid)).status == "COMPLETED"
    assert "CHILD_COMPENSATING" not in kinds(await engine.client.history(iid))
    assert [c["step"] for c in await engine.client.compensations(iid)] == ["home"]
