"""A batch start whose connection is cut mid-statement starts nothing of that batch, and calling again with
the same idempotency keys starts each instance exactly once (a real server backend is terminated while
`start_batch` runs). The batch is held at its last insert (history, locked by the test) until the cut, so the
cut always lands mid-statement, after its other rows were written: polling for a statement that can
finish first raced it (a quiet machine ran the 10,000 rows before a look saw them)."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.errors import DatabaseUnavailable
from stepstone.testing import open_engine
from tests._pg import until_shown

wf: Workflow[Any] = Workflow("batch-cut", version=1)


@wf.step(start=True, next=None)
def only(ctx: StepContext, state: dict[str, Any]) -> None:
    state["done"] = True


registry = Registry(wf)
ITEMS = 10_000


async def _cut_the_batch(conn: asyncpg.Connection) -> int:
    """Terminate the backend running start_batch once it waits for the history lock; its pid."""
    pid = await until_shown(conn, "SELECT pid FROM pg_stat_activity WHERE state = 'active' "
                                  "AND wait_event_type = 'Lock' AND query LIKE '%start_batch(%' "
                                  "AND pid <> pg_backend_pid() AND datname = current_database() LIMIT 1",
                            failure="start_batch was never seen waiting at its history insert")
    await conn.fetchval("SELECT pg_terminate_backend($1)", pid)
    return int(pid)


async def test_a_cut_batch_starts_nothing_and_a_retry_starts_each_once(database_url: str) -> None:
    inputs = [{"n": n} for n in range(ITEMS)]
    keys = [f"item-{n}" for n in range(ITEMS)]
    async with open_engine(database_url, registry, concurrency=2) as engine:
        await engine.client.start(wf, {"warm": True})  # registers the workflow before the cut
        conn = await asyncpg.connect(database_url)
        holder = await asyncpg.connect(database_url)
        try:
            hold = holder.transaction()
            await hold.start()
            await holder.execute("LOCK TABLE stepstone.history IN SHARE MODE")  # inserts wait; reads do not
            cutter = asyncio.create_task(_cut_the_batch(conn))
            try:
                await engine.client.start_many(wf, inputs, idempotency_keys=keys, batch_size=ITEMS)
                raise AssertionError("the batch finished before it could be cut")
            except DatabaseUnavailable:
                pass
            await asyncio.wait_for(cutter, timeout=30)
            await hold.rollback()
            counts = await conn.fetchrow(
                "SELECT (SELECT count(*) FROM stepstone.instances WHERE definition_id = 'batch-cut') AS instances, "
                "(SELECT count(*) FROM stepstone.positions) AS positions, "
                "(SELECT count(*) FROM stepstone.commands WHERE kind = 'START') AS starts, "
                "(SELECT count(*) FROM stepstone.history WHERE kind = 'INSTANCE_STARTED') AS started, "
                "(SELECT count(*) FROM stepstone.dedup WHERE kind = 'START') AS keys")
            assert dict(counts) == {"instances": 1, "positions": 1, "starts": 1, "started": 1, "keys": 0}

            ids = await engine.client.start_many(wf, inputs, idempotency_keys=keys, batch_size=2_500)
            again = await engine.client.start_many(wf, inputs[:100], idempotency_keys=keys[:100])
            assert again == ids[:100] and len(set(ids)) == ITEMS
            assert await conn.fetchval("SELECT count(*) FROM stepstone.instances") == ITEMS + 1
            assert await conn.fetchval("SELECT count(*) FROM stepstone.commands WHERE kind = 'START'") == ITEMS + 1
        finally:
            cutter.cancel()
            await asyncio.gather(cutter, return_exceptions=True)
            await holder.close()
            await conn.close()
