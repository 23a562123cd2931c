"""What a waiting instance stores once (migration 0032), on PostgreSQL: what it waits for lives on its
root position alone, and its start entry holds the baseline state without the pin, which the instance
row (or the first INSTANCE_MIGRATED entry) names. And the bench's seed of waiting instances, which
`stepstone bench` and `tests/perf/waiting_bytes.py` measure bytes on, writes the rows the engine does."""

from __future__ import annotations

import json
from typing import Any

from stepstone import Registry
from stepstone.bench.common import seed_waiting
from stepstone.bench.workflows import waiting
from stepstone.core.pin import pin_of
from stepstone.testing import open_engine
from tests.engine.branch_workflows import Job, parent
from tests.engine.branch_workflows import registry as branch_registry
from tests.engine.conftest import Rows


async def _started_data(rows: Rows, iid: str) -> dict[str, Any]:
    data = await rows.conn.fetchval(
        "SELECT data FROM stepstone.history WHERE instance_id = $1::uuid AND kind = 'INSTANCE_STARTED'", iid)
    return dict(json.loads(data))


async def test_a_waiting_instance_keeps_its_wait_on_its_root_position_alone(database_url: str, rows: Rows) -> None:
    async with open_engine(database_url, branch_registry) as engine:
        iid = await engine.client.start("job", Job(n=1, wait=True).model_dump())
        await engine.run_until_idle()
        copy, on_position = await rows.conn.fetchrow(
            "SELECT i.wait, p.wait FROM stepstone.instances i JOIN stepstone.positions p "
            "ON p.instance_id = i.id AND p.path = '' WHERE i.id = $1::uuid", iid)
        assert copy is None
        assert json.loads(on_position)["kind"] == "signal"
        info = await engine.client.get(iid)
        assert info.status == "WAITING" and info.waiting_for == json.loads(on_position)

        await engine.client.cancel(iid, "done with it")
        await engine.run_until_idle()
        # A cancelled root position keeps its last wait; the instance no longer waits for it.
        assert (await engine.client.get(iid)).waiting_for is None


async def test_the_start_entry_holds_the_baseline_without_the_pin(database_url: str, rows: Rows) -> None:
    async with open_engine(database_url, branch_registry) as engine:
        one = await engine.client.start("job", Job(n=2).model_dump())
        [batched] = await engine.client.start_many("job", [Job(n=3).model_dump()])
        above = await engine.client.start(parent, Job(n=4, wait=True).model_dump())
        await engine.run_until_idle()
        assert await _started_data(rows, one) == {"state": Job(n=2).model_dump()}
        assert await _started_data(rows, batched) == {"state": Job(n=3).model_dump()}
        [child] = await rows.conn.fetch("SELECT id FROM stepstone.instances WHERE parent_id = $1::uuid", above)
        assert await _started_data(rows, str(child["id"])) == {
            "state": Job(n=4, wait=True).model_dump(), "parent": above, "parent_position": ""}
        pin = await rows.conn.fetchrow("SELECT version, plan_hash FROM stepstone.instances WHERE id = $1::uuid", one)
        assert (pin["version"], len(pin["plan_hash"])) == (1, 64)  # where the pin it started on is kept


def _shape(value: Any) -> Any:
    """Which keys a document has, all the way down (not their values)."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    return type(value).__name__ if value is not None else None


async def _layout(rows: Rows, iid: Any) -> dict[str, Any]:
    """The columns each of the instance's rows sets (not null), and the shape of each history entry."""
    def set_columns(records: list[Any]) -> list[list[str]]:
        skip = {"id", "instance_id", "command_id", "token", "created_at", "updated_at", "settled_at", "at",
                "available_at", "lease_until", "claimed_by"}
        return [sorted(k for k, v in dict(r).items() if v is not None and k not in skip) for r in records]

    instance = await rows.conn.fetch("SELECT * FROM stepstone.instances WHERE id = $1", iid)
    positions = await rows.conn.fetch("SELECT * FROM stepstone.positions WHERE instance_id = $1", iid)
    commands = await rows.conn.fetch("SELECT * FROM stepstone.commands WHERE instance_id = $1 ORDER BY id", iid)
    history = await rows.conn.fetch("SELECT * FROM stepstone.history WHERE instance_id = $1 ORDER BY seq", iid)
    return {
        "instance": set_columns(instance),
        "positions": [(cols, _shape(json.loads(p["wait"])))
                      for p, cols in zip(positions, set_columns(positions), strict=True)],
        "commands": [(c["kind"], c["state"], cols) for c, cols in zip(commands, set_columns(commands), strict=True)],
        "history": [(h["kind"], cols, _shape(json.loads(h["data"])), _shape(json.loads(h["actor"] or "null")))
                    for h, cols in zip(history, set_columns(history), strict=True)],
    }


async def test_the_bench_seed_writes_what_the_engine_writes(database_url: str, rows: Rows) -> None:
    async with open_engine(database_url, Registry(waiting)) as engine:
        iid = await engine.client.start(waiting, {"n": 0, "payload": "x" * 80})
        await engine.run_until_idle()
        assert (await engine.client.get(iid)).step == "sleep"
        by_engine = await _layout(rows, iid)
        await seed_waiting(rows.conn, "stepstone", pin_of(waiting), 2, 2)  # instance 2: on the timer, as this one
        seeded = await rows.conn.fetchval(
            "SELECT id FROM stepstone.instances WHERE id <> $1::uuid AND definition_id = 'bench_waiting'", iid)
        assert await _layout(rows, seeded) == by_engine


async def test_the_bench_seed_writes_in_start_order(rows: Rows) -> None:
    """Each start writes its rows after the previous start's, so every index keyed by the instance (ids in
    time order) grows at its right edge and fills its pages; the seed's rows must land in that order too,
    or the bytes it measures count half-empty index pages the engine never leaves."""
    await seed_waiting(rows.conn, "stepstone", pin_of(waiting), 1, 2_000)
    for table, key in (("instances", "id"), ("positions", "instance_id"), ("commands", "instance_id"),
                       ("history", "instance_id")):
        behind = await rows.conn.fetchval(
            f"SELECT count(*) FROM (SELECT {key} < lag({key}) OVER (ORDER BY ctid) AS back "
            f"FROM stepstone.{table}) AS r WHERE back")
        assert (table, behind) == (table, 0)
