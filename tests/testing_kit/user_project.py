"""A user's project tested with the stepstone pytest plugin: the files docs/testing.md shows."""

CONFTEST = '''
import pytest

from stepstone.examples.orders import registry


@pytest.fixture
def stepstone_registry():
    return registry
'''

TEST_ORDERS = '''
from stepstone.examples.orders import orders

ORDER = {"order_id": "o-1", "customer": "ada", "lines": [{"sku": "book", "quantity": 1}]}


async def test_an_unpaid_order_is_released_after_a_day(engine):
    iid = await engine.client.start(orders, ORDER)
    await engine.advance(days=2)  # the cooling-off timer, then the payment timeout, fire on the way
    info = await engine.client.get(iid)
    assert info.status == "COMPLETED"
    assert info.state["outcome"] == "payment timed out"
    await engine.assert_step_ran(iid, "reserve_stock", times=1)
    await engine.assert_step_ran(
        iid, "release_stock", times=1,
        patch=[{"op": "replace", "path": "/outcome", "value": "payment timed out"}],
    )
    await engine.assert_step_ran(iid, "ship", times=0)


async def test_a_paid_order_ships(engine):
    iid = await engine.client.start(orders, ORDER)
    await engine.advance(seconds=3)  # past the cooling-off timer: the order waits for payment
    assert (await engine.client.get(iid)).step == "await_payment"
    await engine.client.signal(iid, "payment_received", {"payment_id": "pay-1"})
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.state["outcome"], info.state["payment_id"]) == ("COMPLETED", "shipped", "pay-1")
'''

PYTEST_INI = '''
[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = function
'''
