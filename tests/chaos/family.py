"""The rig's parent and child sagas (test_child_kills.py; the scenarios' workload never starts them):

  chaosleg-2  the child: s1 and s2, each compensated (undo_s1, undo_s2); s2 lingers the state's `slow2`
              seconds after its effect, then fails for good when `fail` says so: the child then compensates
              its s1 on its own and ends COMPENSATED, which its parent takes as the child's failure
  chaoskin-3  the parent: s1 (compensated by undo_s1), the child step `kid` starting a chaosleg-2 child
              (`fail` and `slow2` from the parent's `leg_fail` and `slow2`) with `fallback` as its
              on_failure, then s3, which keeps the child's id and status and then fails for good when `fail`
              says so (the parent's saga then undoes the child and s1). A rig worker that claims the child's
              COMPLETED report holds it until the parent's saga begins, at most `hold_report` seconds, before
              applying it (worker_proc): the window in which a cancel with compensation or the instance
              deadline must still compensate the child.

Every handler records its effect in the ledger, then lingers (`slow2`, or CHAOS_HANDLER_PAUSE seconds).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from pydantic import BaseModel

from stepstone.authoring.workflow import CompensationContext, Retry, StepContext, Workflow
from tests.chaos.ledger import PAUSE_ENV, record_effect

_RETRY = Retry(max_attempts=10, backoff=0.2)
_ONCE = Retry(max_attempts=1)


class Refused(Exception):
    """A step told to fail (never retried)."""


class Leg(BaseModel):
    fail: bool = False
    slow2: float = 0.0
    undone: list[str] = []


HOLD_REPORT = "hold_report"
"""The parent's state field: a rig worker that claimed the child's COMPLETED report holds it until the parent's saga
begins, at most that many seconds (worker_proc)."""


class Kin(BaseModel):
    fail: bool = False
    leg_fail: bool = False
    slow2: float = 0.0
    hold_report: float = 0.0
    child_id: str | None = None
    child_status: str | None = None
    undone: list[str] = []


async def _linger(seconds: float) -> None:
    seconds = seconds or float(os.environ.get(PAUSE_ENV, "0") or 0)
    if seconds > 0:
        await asyncio.sleep(seconds)  # simulated work after the effect: the window a kill or a cancel hits


async def _effect(ctx: StepContext | CompensationContext, seconds: float = 0.0) -> None:
    await record_effect(ctx)
    await _linger(seconds)


async def _undo(ctx: CompensationContext, state: Any, recorded: Any) -> None:
    await _effect(ctx)  # key: instance/compensate/record, the compensation's idempotency key
    state.undone.append(ctx.step)


def _leg() -> Workflow[Leg]:
    wf: Workflow[Leg] = Workflow("chaosleg-2", version=1, state=Leg)

    async def s1(ctx: StepContext, state: Leg) -> None:
        await _effect(ctx)

    async def s2(ctx: StepContext, state: Leg) -> None:
        await _effect(ctx, state.slow2)
        if state.fail:
            raise Refused("the leg is refused")

    wf.step(s1, name="s1", start=True, next="s2", retry=_RETRY)
    wf.step(s2, name="s2", next=None, retry=_ONCE)
    wf.compensation("s1", retry=_RETRY, name="undo_s1")(_undo)
    wf.compensation("s2", retry=_RETRY, name="undo_s2")(_undo)
    return wf


def _kin() -> Workflow[Kin]:
    wf: Workflow[Kin] = Workflow("chaoskin-3", version=1, state=Kin)

    async def s1(ctx: StepContext, state: Kin) -> None:
        await _effect(ctx)

    async def kid(ctx: StepContext, state: Kin) -> dict[str, Any]:
        await _effect(ctx)
        return {"fail": state.leg_fail, "slow2": state.slow2}

    async def fallback(ctx: StepContext, state: Kin) -> None:
        await _effect(ctx)
        assert ctx.child is not None, ctx
        state.child_id, state.child_status = ctx.child.instance_id, ctx.child.status

    async def s3(ctx: StepContext, state: Kin) -> None:
        assert ctx.child is not None, ctx
        state.child_id, state.child_status = ctx.child.instance_id, ctx.child.status
        await _effect(ctx)
        if state.fail:
            raise Refused("the parent's last step is refused")

    wf.step(s1, name="s1", start=True, next="kid", retry=_RETRY)
    wf.child(kid, name="kid", workflow="chaosleg-2", next="s3", on_failure="fallback")
    wf.step(fallback, name="fallback", next=None, retry=_RETRY)
    wf.step(s3, name="s3", next=None, retry=_ONCE)
    wf.compensation("s1", retry=_RETRY, name="undo_s1")(_undo)
    return wf


LEG: Workflow[Any] = _leg()
KIN: Workflow[Any] = _kin()
