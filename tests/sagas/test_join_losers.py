"""A branch a join did not need (closed JOIN_COMPLETE) keeps its completed steps among the compensations; a
child that completed in it is compensated with them, whether its report was applied or still queued."""

from __future__ import annotations

import pytest

from stepstone.authoring.workflow import Registry
from stepstone.testing import Engine, open_engine
from tests.sagas import workflows as w
from tests.sagas.conftest import kinds


async def _loser_with_a_completed_child(engine: Engine, database_url: str) -> tuple[str, str]:
    """rivals: branch a ran prep and its child completed (on a worker that serves only `pair`, so its report
    waits at the parent); branch b waits for "go"."""
    iid = await engine.client.start(w.rivals, {})
    await engine.run_until_idle()
    [kid] = [str(c["id"]) for c in (await engine.client.get(iid)).children]
    async with open_engine(database_url, Registry(w.pair), concurrency=2, lease_seconds=30) as pairs:
        await pairs.client.signal(kid, "go")
        await pairs.run_until_idle()
    assert (await engine.client.get(kid)).status == "COMPLETED"
    return iid, kid


async def _b_wins_and_settle_fails(engine: Engine, iid: str, kid: str) -> None:
    await engine.client.signal(iid, "go", position="split/b")
    await engine.run_until_idle()
    history = await engine.client.history(iid)
    assert "JOINED" in kinds(history)
    info = await engine.client.get(iid)
    # The loser's own step (prep) and its child are undone with the rest, newest first.
    assert (info.status, info.state["undone"]) == ("COMPENSATED", ["prep:p", "home:h"])
    assert (await engine.client.get(kid)).status == "COMPENSATED"
    assert (await engine.client.get(kid)).state["undone"] == ["pair_two:p2", "pair_one:p1"]
    assert [(i == kid, c) for i, c in w.CALLS] == [
        (True, "pair_two"), (True, "pair_one"), (False, "prep"), (False, "home")]
    assert [h["step"] for h in history if h["kind"] == "STEP_COMPENSATED"] == ["kid", "prep", "home"]


async def test_a_child_whose_report_was_applied_in_a_branch_the_join_closed_is_compensated(
    engine: Engine, database_url: str,
) -> None:
    iid, kid = await _loser_with_a_completed_child(engine, database_url)
    await engine.run_until_idle()  # the report is applied: branch a waits in linger
    assert [p["step"] for p in (await engine.client.get(iid)).positions if p["path"] == "split/a"] == ["linger"]
    await _b_wins_and_settle_fails(engine, iid, kid)


async def test_a_child_whose_report_waits_in_a_branch_the_join_closed_is_compensated(
    engine: Engine, database_url: str,
) -> None:
    """The parent's worker claimed the child's report and died; branch b reaches the join meanwhile."""
    iid, kid = await _loser_with_a_completed_child(engine, database_url)
    [claim] = await engine.store.claim(1, 600, "dead-worker", [w.rivals.id])
    assert claim.command.kind == "CHILD_COMPLETION"
    await _b_wins_and_settle_fails(engine, iid, kid)



async def _twins(engine: Engine, database_url: str, *, complete: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """twins: the children of branches `complete` completed on a worker that serves only `pair` (their reports
    wait at the parent); the others wait for "go"."""
    iid = await engine.client.start(w.twins, {})
    await engine.run_until_idle()
    kids = {str(c["position"]): str(c["id"]) for c in (await engine.client.get(iid)).children}
    async with open_engine(database_url, Registry(w.pair), concurrency=2, lease_seconds=30) as pairs:
        for branch in complete:
            await pairs.client.signal(kids[f"split/{branch}"], "go")
        await pairs.run_until_idle()
    return iid, kids


@pytest.mark.parametrize(("complete", "applied"), [(("a", "b"), False), (("a",), False), (("a",), True)])
async def test_a_fork_with_a_child_in_each_branch_cancelled_with_compensation_undoes_each_child_once(
    engine: Engine, database_url: str, complete: tuple[str, ...], applied: bool,
) -> None:
    iid, kids = await _twins(engine, database_url, complete=complete)
    if applied:
        await engine.run_until_idle()  # a's report applied: a waits at the join
    assert await engine.client.cancel(iid, "stop", compensate=True) == "COMPENSATING"
    await engine.run_until_idle()

    info = await engine.client.get(iid)
    assert (info.status, info.state["undone"]) == ("CANCELLED", ["home:h"])
    for branch, kid in kids.items():
        child = await engine.client.get(kid)
        assert child.status == "COMPENSATED", branch
        done = ["pair_two:p2", "pair_one:p1"] if branch[-1] in complete else []
        assert child.state["undone"] == done, branch
    calls = [(i, c) for i, c in w.CALLS]
    assert len(calls) == len(set(calls)) == 2 * len(complete) + 1  # each compensation once
    history = await engine.client.history(iid)
    assert sorted(h["step"] for h in history if h["kind"] == "STEP_COMPENSATED") == ["home", "kid", "kid_b"]


async def test_a_child_still_running_in_a_branch_the_join_closed_stays_cancelled_when_the_parent_compensates(
    engine: Engine,
) -> None:
    """The join cancels it (a plain cancel), and the parent's later saga does not reopen it (docs/sagas.md)."""
    iid = await engine.client.start(w.rivals, {})
    await engine.run_until_idle()
    [kid] = [str(c["id"]) for c in (await engine.client.get(iid)).children]
    await engine.client.signal(iid, "go", position="split/b")
    await engine.run_until_idle()

    info = await engine.client.get(iid)
    assert (info.status, info.state["undone"]) == ("COMPENSATED", ["prep:p", "home:h"])
    assert (await engine.client.get(kid)).status == "CANCELLED"
    assert "CHILD_COMPENSATING" not in kinds(await engine.client.history(iid))
    assert [c for _, c in w.CALLS] == ["prep", "home"]
