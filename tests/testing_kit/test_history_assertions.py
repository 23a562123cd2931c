"""The engine's history assertions take only steps that record completed runs: a misspelt step, or a
timer or wait, would otherwise count 0 and pass `times=0`."""

from __future__ import annotations

import pytest

from stepstone.errors import InvalidInput
from stepstone.examples.orders import orders, registry
from stepstone.testing import open_engine

ORDER = {"order_id": "o-1", "customer": "ada", "lines": [{"sku": "book", "quantity": 1}]}


async def test_a_step_the_workflow_lacks_is_refused_naming_its_steps(database_url: str) -> None:
    async with open_engine(database_url, registry) as engine:
        iid = await engine.client.start(orders, ORDER)
        await engine.run_until_idle()
        with pytest.raises(InvalidInput, match=r"workflow 'order' v1 has no step 'shipp'; its steps: "
                                               r"reserve_stock, cooling_off, await_payment, ship, .*release_stock"):
            await engine.assert_step_ran(iid, "shipp", times=0)
        with pytest.raises(InvalidInput, match="has no step 'nonexistent'"):
            await engine.step_runs(iid, "nonexistent")
        await engine.assert_step_ran(iid, "ship", times=0)  # a real step that has not run yet
        assert (await engine.step_runs(iid, "reserve_stock")).times == 1


async def test_a_step_without_a_handler_is_refused_saying_which_are_counted(database_url: str) -> None:
    async with open_engine(database_url, registry) as engine:
        iid = await engine.client.start(orders, ORDER)
        await engine.advance(seconds=3)  # past the cooling-off timer
        for step, kind in (("cooling_off", "timer"), ("await_payment", "wait")):
            with pytest.raises(InvalidInput, match=rf"step '{step}' of workflow 'order' v1 is a {kind} step: only "
                                                   r"action and child steps run a handler.*: reserve_stock, ship"):
                await engine.assert_step_ran(iid, step, times=1)
