"""A commit under a lost lease is refused by the fence before its state version is compared.

Otherwise a zombie (paused past its lease while another worker took the position over and changed the
shared state) is answered 'conflict' instead of 'fenced', and the worker runs the step's handler again on
the current state, repeating its effect for a position it no longer holds, until a later commit of it is
finally fenced. The zombies scenario showed it as repeated effects per pause well above one per handler.
"""

from __future__ import annotations

from typing import Any

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.core.model import RunStep, StepSucceeded
from stepstone.core.transitions import apply, complete_step
from stepstone.runtime.worker import pin_of
from stepstone.store.port import Claim, CommitRequest
from stepstone.testing import open_engine

wf: Workflow[Any] = Workflow("fence-first", version=1)


@wf.step(start=True, next=None)
def bump(ctx: StepContext, state: dict[str, Any]) -> None:
    state["n"] = state.get("n", 0) + 1


registry = Registry(wf)


async def _commit(engine: Any, claim: Claim, state: dict[str, Any]) -> Any:
    run = apply(claim.instance, claim.command, wf.plan, claim.now)
    assert isinstance(run, RunStep)
    decision = complete_step(claim.instance, claim.command, wf.plan, StepSucceeded(None, state), claim.now)
    request = CommitRequest(claim, claim.command.id, decision, run.visit, claim.instance.state_version)
    return await engine.store.commit(request, lease_seconds=5.0, worker="test")


async def test_a_stale_token_is_fenced_before_the_state_version_is_compared(database_url: str) -> None:
    async with open_engine(database_url, registry) as engine:
        await engine.store.register(pin_of(wf), wf.plan.document())
        iid = await engine.client.start(wf, {"n": 0})
        [zombie] = await engine.store.claim(1, 5.0, "zombie")
        await engine.move_clock(6)  # the zombie's lease expires
        [taker] = await engine.store.claim(1, 5.0, "taker")
        assert taker.instance.id == zombie.instance.id == iid
        assert (await _commit(engine, taker, {"n": 1})) is not None  # changes the shared state
        late = await _commit(engine, zombie, {"n": 1})
        assert late is None, f"the zombie's commit should be fenced, got {late}"
