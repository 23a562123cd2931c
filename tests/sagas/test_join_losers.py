"""A branch a join did not need (closed JOIN_COMPLETE) keeps its completed steps among the compensations; a
child that completed in it is compensated with them, whether its report was applied or still queued."""

from __future__ import annotations

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

