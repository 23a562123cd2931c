"""Group start (`stepstone.store.start_groups`): concurrent `Client.start` calls of one version share a
`start_batch` statement, write what single starts write, and each caller still gets the outcome its
own start would have had, a refused neighbour in the same group included."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from stepstone.errors import BusinessKeyInUse, IdempotencyConflict
from stepstone.store.postgres import PostgresStore
from stepstone.testing import Engine
from tests.engine.conftest import Rows
from tests.engine.test_start_many import _rows_of
from tests.engine.workflows import three


def _count_statements(engine: Engine) -> Counter[str]:
    """Count the group's statements: `one` (a single start) and `many` (a group's start_batch)."""
    store = engine.client.store
    assert isinstance(store, PostgresStore)
    groups = store._starts
    counts: Counter[str] = Counter()

    def counted(name: str, send: Callable[[Any], Awaitable[Any]]) -> Callable[[Any], Awaitable[Any]]:
        async def call(arg: Any) -> Any:
            counts[name] += 1
            return await send(arg)
        return call

    groups._one = counted("one", groups._one)  # type: ignore[method-assign]
    groups._many = counted("many", groups._many)  # type: ignore[method-assign]
    return counts


async def test_concurrent_starts_share_a_statement_and_each_runs(engine: Engine, rows: Rows) -> None:
    single = await engine.client.start(three, {"order_id": "o-7"})  # registers, and is the reference
    counts = _count_statements(engine)
    ids = await asyncio.gather(*(engine.client.start(three, {"order_id": f"o-{n}"}) for n in range(40)))
    assert len(set(ids)) == 40 and single not in ids
    assert counts["many"] >= 1 and counts["one"] + counts["many"] < 40, counts
    assert await _rows_of(rows.conn, ids[7]) == await _rows_of(rows.conn, single)
    await engine.run_until_idle()
    for n, iid in enumerate(ids):  # each caller got the id of its own input
        info = await engine.client.get(iid)
        assert info.status == "COMPLETED" and info.state["order_id"] == f"o-{n}"


async def test_a_lone_start_goes_alone(engine: Engine) -> None:
    await engine.client.start(three, {"order_id": "first"})
    counts = _count_statements(engine)
    for n in range(3):
        await engine.client.start(three, {"order_id": f"o-{n}"})
    assert counts == Counter(one=3)


async def test_a_refused_start_does_not_sink_its_group(engine: Engine, rows: Rows) -> None:
    holder = await engine.client.start(three, {"order_id": "held"}, business_key="taken")
    counts = _count_statements(engine)
    calls = [
        engine.client.start(three, {"order_id": "a"}),
        engine.client.start(three, {"order_id": "b"}, business_key="taken"),  # in use: refused
        engine.client.start(three, {"order_id": "c"}, idempotency_key="k"),
        engine.client.start(three, {"order_id": "c"}, idempotency_key="k"),  # the same start again
        engine.client.start(three, {"order_id": "d"}, idempotency_key="j"),
        engine.client.start(three, {"order_id": "other"}, idempotency_key="j"),  # the key with other input
        engine.client.start(three, {"order_id": "e"}, business_key="twice"),
        engine.client.start(three, {"order_id": "f"}, business_key="twice"),  # the group's own key
        engine.client.start(three, {"order_id": "g"}),
    ]
    a, b, c1, c2, d1, d2, e, f, g = await asyncio.gather(*calls, return_exceptions=True)
    assert counts["many"] >= 1, counts  # the group was tried, refused, and started one by one
    assert isinstance(b, BusinessKeyInUse) and b.instance_id == holder
    assert isinstance(c1, str) and c1 == c2
    assert isinstance(d1, str) and isinstance(d2, IdempotencyConflict) and d2.instance_id == d1
    assert isinstance(e, str) and isinstance(f, BusinessKeyInUse) and f.instance_id == e
    assert await rows.count("SELECT count(*) FROM stepstone.instances") == 6  # held, a, c, d, e, g
    await engine.run_until_idle()
    for iid, order in ((a, "a"), (c1, "c"), (d1, "d"), (e, "e"), (g, "g")):
        assert isinstance(iid, str)
        info = await engine.client.get(iid)
        assert info.status == "COMPLETED" and info.state["order_id"] == order


async def test_a_cancelled_caller_leaves_its_group_to_the_others(engine: Engine) -> None:
    await engine.client.start(three, {"order_id": "first"})
    tasks = [asyncio.create_task(engine.client.start(three, {"order_id": f"o-{n}"})) for n in range(6)]
    await asyncio.sleep(0)  # each has queued its start
    tasks[2].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[2], asyncio.CancelledError)
    started = [r for n, r in enumerate(done) if n != 2]
    assert all(isinstance(r, str) for r in started) and len(set(started)) == 5
