"""Grouped starts under cut connections: many callers start concurrently (their starts share
`start_batch` statements, `stepstone.store.start_groups`) while a killer terminates server backends
running them. A caller whose start failed calls again with its idempotency key. At the end every key has
exactly one instance, every caller holds that instance's id, and every instance ran once."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.errors import DatabaseUnavailable
from stepstone.testing import open_engine

wf: Workflow[Any] = Workflow("group-cut", version=1)
RAN: list[int] = []


@wf.step(start=True, next=None)
def only(ctx: StepContext, state: dict[str, Any]) -> None:
    RAN.append(state["n"])


registry = Registry(wf)
CALLERS, STARTS_EACH, KILLS = 16, 25, 25


async def _killer(conn: asyncpg.Connection, stop: asyncio.Event) -> int:
    """Terminate backends seen running a start, KILLS of them spaced out, until `stop`; how many."""
    killed = 0
    while not stop.is_set() and killed < KILLS:
        pid = await conn.fetchval("SELECT pid FROM pg_stat_activity WHERE state = 'active' "
                                  "AND pid <> pg_backend_pid() AND datname = current_database() "
                                  "AND (query LIKE '%start_batch(%' OR query LIKE '%start_instance(%') LIMIT 1")
        if pid is not None and await conn.fetchval("SELECT pg_terminate_backend($1)", pid):
            killed += 1
            await asyncio.sleep(0.02)  # let some groups through between cuts
        await asyncio.sleep(0.001)
    return killed


async def test_cut_group_starts_lose_nothing_and_start_nothing_twice(database_url: str) -> None:
    RAN.clear()
    failures = 0

    async def caller(c: int) -> dict[str, str]:
        nonlocal failures
        got: dict[str, str] = {}
        for s in range(STARTS_EACH):
            key = f"c{c}-s{s}"
            while True:
                try:
                    got[key] = await engine.client.start(wf, {"n": c * STARTS_EACH + s}, idempotency_key=key)
                    break
                except DatabaseUnavailable:
                    failures += 1
                    await asyncio.sleep(0.001)
        return got

    async with open_engine(database_url, registry, concurrency=4) as engine:
        await engine.client.start(wf, {"n": -1})  # registers the workflow before the cuts
        conn = await asyncpg.connect(database_url)
        stop = asyncio.Event()
        killer = asyncio.create_task(_killer(conn, stop))
        try:
            results = await asyncio.wait_for(asyncio.gather(*(caller(c) for c in range(CALLERS))), timeout=240)
        finally:
            stop.set()
            killed = await killer
        try:
            assert killed > 0 and failures > 0, "no start was cut: the test proved nothing"
            ids = {key: iid for got in results for key, iid in got.items()}
            assert len(ids) == CALLERS * STARTS_EACH
            rows = await conn.fetch("SELECT d.key, d.target FROM stepstone.dedup d WHERE d.kind = 'START'")
            assert {r["key"]: r["target"] for r in rows} == ids  # one instance per key, the one its caller holds
            assert await conn.fetchval("SELECT count(*) FROM stepstone.instances") == len(ids) + 1
            await engine.run_until_idle()
        finally:
            await conn.close()
    assert sorted(RAN) == list(range(-1, CALLERS * STARTS_EACH))  # every instance ran, once
