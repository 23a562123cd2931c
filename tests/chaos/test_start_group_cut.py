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


async def _killer(conn: asyncpg.Connection, stop: asyncio.Event, progress: asyncio.Condition,
                  started: list[int]) -> int:
    """Terminate backends seen running a start, KILLS of them, until `stop`; how many. After each cut
    it waits for ten more starts to succeed, so groups also get through between cuts."""
    killed = 0
    while not stop.is_set() and killed < KILLS:
        pid = await conn.fetchval("SELECT pid FROM pg_stat_activity WHERE state = 'active' "
                                  "AND pid <> pg_backend_pid() AND datname = current_database() "
                                  "AND (query LIKE '%start_batch(%' OR query LIKE '%start_instance(%') LIMIT 1")
        if pid is not None and await conn.fetchval("SELECT pg_terminate_backend($1)", pid):
            killed += 1
            goal = started[0] + 10
            async with progress:
                await progress.wait_for(lambda goal=goal: started[0] >= goal or stop.is_set())
    return killed


async def test_cut_group_starts_lose_nothing_and_start_nothing_twice(database_url: str) -> None:
    RAN.clear()
    failures = 0
    started, progress = [0], asyncio.Condition()

    async def caller(c: int) -> dict[str, str]:
        nonlocal failures
        got: dict[str, str] = {}
        for s in range(STARTS_EACH):
            key = f"c{c}-s{s}"
            while True:
                try:
                    got[key] = await engine.client.start(wf, {"n": c * STARTS_EACH + s}, idempotency_key=key)
                except DatabaseUnavailable:
                    failures += 1  # called again at once: the pool opens a new connection
                    continue
                started[0] += 1
                async with progress:
                    progress.notify_all()
                break
        return got

    async with open_engine(database_url, registry, concurrency=4) as engine:
        await engine.client.start(wf, {"n": -1})  # registers the workflow before the cuts
        conn = await asyncpg.connect(database_url)
        stop = asyncio.Event()
        killer = asyncio.create_task(_killer(conn, stop, progress, started))
        try:
            results = await asyncio.wait_for(asyncio.gather(*(caller(c) for c in range(CALLERS))), timeout=240)
        finally:
            stop.set()
            async with progress:
                progress.notify_all()
            killed = await killer
        try:
            assert killed > 0 and failures > 0, "no start was cut: the test proved nothing"
            ids = {key: iid for got in results for key, iid in got.items()}
            assert len(ids) == CALLERS * STARTS_EACH
            rows = await conn.fetch("SELECT d.key, d.target FROM stepstone.dedup d WHERE d.kind = 'START'")
            assert {r["key"]: r["target"] for r in rows} == ids  # one instance per key, the one its caller holds
            assert await conn.fetchval("SELECT count(*) FROM stepstone.instances") == len(ids) + 1
            # A backend terminated mid-statement can leave its pooled connection unusable for one more
            # call ("cannot switch to state 11; another operation is in progress", asyncpg issue 784):
            # a worker's loops retry it, run_until_idle does not. The cuts are over: fresh connections.
            await engine.store.pool.expire_connections()
            await engine.run_until_idle()
        finally:
            await conn.close()
    assert sorted(RAN) == list(range(-1, CALLERS * STARTS_EACH))  # every instance ran, once
