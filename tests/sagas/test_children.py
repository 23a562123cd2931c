"""A child workflow the saga completed is compensated by compensating the child: its own
compensations run (in its own reverse order), and the parent goes on once the child reports."""

from __future__ import annotations

from stepstone.core.transitions import child_id
from stepstone.testing import Engine
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
