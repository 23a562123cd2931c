"""A callback for a cancelled branch is recorded in history and ignored, never applied.

The join needs any one branch: `l` reaches it while `r` waits for a child it abandons when cancelled
(`cancel_with_parent=False`). The join cancels `r`; the abandoned child runs on, and its end reports to
the closed position `f/r` after the parent moved on to a wait.

The worker runs one segment at a time, so the order is fixed: the fork queues both branches' first steps,
and `l`'s arrival at the join is a command queued after them, so `r1` has started the child before the
join cancels `r`. With several slots both branches ran at once, and a slow `r1` could still be running
when `l`'s arrival was claimed and the join closed `r`: its commit was then refused and no child was
started (seen once in CI, under load).
"""

from __future__ import annotations

from typing import Any

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.testing import open_engine

parent: Workflow[Any] = Workflow("late-callback", version=1)
parent.fork("f", branches={"l": "l1", "r": "r1"}, start=True)


@parent.step(next="j")
def l1(ctx: StepContext, state: dict[str, Any]) -> None:
    state["l"] = "done"


@parent.child(workflow="late-kid", next="r2", cancel_with_parent=False)
def r1(ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
    return {}


@parent.step(next="j")
def r2(ctx: StepContext, state: dict[str, Any]) -> None:
    state["r"] = "applied"  # must never run: its branch was cancelled


parent.join("j", fork="f", next="w", need="any")
parent.wait("w", signals={"go": "end"})


@parent.step(next=None)
def end(ctx: StepContext, state: dict[str, Any]) -> None:
    """The parent stays at `w` for the test."""


kid: Workflow[Any] = Workflow("late-kid", version=1)
kid.timer("t", delay=60, next="k1", start=True)


@kid.step(next=None)
def k1(ctx: StepContext, state: dict[str, Any]) -> None:
    state["kid"] = "done"


registry = Registry(parent, kid)


async def test_an_abandoned_childs_end_on_a_cancelled_branch_is_recorded_and_ignored(database_url: str) -> None:
    async with open_engine(database_url, registry, concurrency=1) as engine:
        iid = await engine.client.start(parent, {})
        await engine.run_until_idle()
        pool = engine.store.pool
        positions = dict(await pool.fetch(
            "SELECT path, status FROM stepstone.positions WHERE instance_id = $1", iid))
        assert positions == {"": "WAITING", "f/l": "COMPLETED", "f/r": "CANCELLED"}, positions
        child = await pool.fetchrow("SELECT id, status FROM stepstone.instances WHERE parent_id = $1", iid)
        assert child is not None and child["status"] == "WAITING"  # abandoned, not cancelled
        await engine.move_clock(61)  # the child's timer fires; the child ends and reports to f/r
        await engine.run_until_idle()
        assert await engine.store.status(str(child["id"])) == "COMPLETED"
        ignored = await pool.fetch(
            "SELECT position, data FROM stepstone.history WHERE instance_id = $1 AND kind = 'CALLBACK_IGNORED'", iid)
        assert len(ignored) == 1 and ignored[0]["position"] == "f/r", [dict(r) for r in ignored]
        command = await pool.fetchrow(
            "SELECT state, last_error FROM stepstone.commands WHERE instance_id = $1 AND kind = 'CHILD_COMPLETION'",
            iid)
        assert command is not None and command["state"] == "REJECTED", command
        row = await pool.fetchrow("SELECT status, step, state FROM stepstone.instances WHERE id = $1", iid)
        assert row["status"] == "WAITING" and row["step"] == "w", dict(row)
        assert "applied" not in str(row["state"]), "the cancelled branch's next step ran"
        assert not await pool.fetchval(
            "SELECT count(*) FROM stepstone.history WHERE instance_id = $1 AND kind = 'CHILD_COMPLETED'", iid)
