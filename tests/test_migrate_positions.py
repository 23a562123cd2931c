"""Migration 0002 (positions) on a database that instances of the previous release left behind."""

from __future__ import annotations

import json
import uuid

import asyncpg
import pytest

from stepstone.runtime.worker import pin_of
from stepstone.store import migrate as m
from stepstone.testing import open_engine
from tests.engine import workflows


async def _start_old(conn: asyncpg.Connection, wf: object, step: str) -> str:
    """What the previous release's start wrote: instance row, START command, no position."""
    pin = pin_of(wf)  # type: ignore[arg-type]
    iid = str(uuid.uuid4())
    await conn.execute(
        "SELECT stepstone.start_instance($1, 'default', $2, $3, $4, $5::jsonb, $6, NULL, NULL, 'f', NULL, NULL)",
        uuid.UUID(iid), pin.definition_id, pin.version, pin.plan_hash, json.dumps({"order_id": iid[:8]}), step,
    )
    return iid


async def test_instances_of_the_previous_release_run_on(
    empty_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = await asyncpg.connect(empty_database_url)
    try:
        first = m.shipped_migrations()[:1]
        monkeypatch.setattr(m, "shipped_migrations", lambda: first)
        assert [x.version for x in await m.migrate(conn, "stepstone")] == [1]
        fresh = await _start_old(conn, workflows.three, "a")
        waiting = await _start_old(conn, workflows.waiter, "parked")
        # The second one got as far as its wait under the previous release.
        await conn.execute(
            "UPDATE stepstone.instances SET status = 'WAITING', wait = $2::jsonb, history_seq = 2 WHERE id = $1",
            uuid.UUID(waiting), json.dumps({"kind": "signal", "signals": {"go": "wrap_up"}, "timeout_seconds": None}),
        )
        await conn.execute(
            "UPDATE stepstone.commands SET state = 'COMPLETE' WHERE instance_id = $1", uuid.UUID(waiting)
        )
        await conn.execute(
            "INSERT INTO stepstone.history (instance_id, seq, at, kind, step, visit) VALUES ($1, 2, now(), 'WAITING', "
            "'parked', 1)", uuid.UUID(waiting))
        monkeypatch.undo()
        assert next(x.version for x in await m.migrate(conn, "stepstone")) == 2
        positions = {str(r["instance_id"]): r["status"] for r in await conn.fetch("SELECT * FROM stepstone.positions")}
        assert positions == {fresh: "RUNNING", waiting: "WAITING"}
        # The old columns stay readable.
        assert await conn.fetchval("SELECT step FROM stepstone.instances WHERE id = $1", uuid.UUID(waiting)) == "parked"
    finally:
        await conn.close()

    async with open_engine(empty_database_url, workflows.registry) as engine:
        await engine.run_until_idle()
        assert (await engine.client.get(fresh)).status == "COMPLETED"
        assert (await engine.client.get(waiting)).status == "WAITING"
        await engine.client.signal(waiting, "go")
        await engine.run_until_idle()
        info = await engine.client.get(waiting)
        assert info.status == "COMPLETED" and info.state["log"] == ["wrapped"]
