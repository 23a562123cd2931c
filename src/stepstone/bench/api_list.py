"""The management API's instance list and task inbox at scale: server-side time of
``GET /api/v1/instances`` pages, of the per-status counts, of the UI's list page (which shows both),
and of ``GET /api/v1/tasks`` pages and counts over `TASKS` open tasks (100,000 at full size).

Seeds `sizes.scale_large` waiting instances (1,000,000 at full size; 10,000 for --quick, to keep CI's
bench short) as the scale workload does,
spreads them over two scopes and a failed share, then times requests through the app in-process
(httpx's ASGI transport: the app and its queries, no network), for an all-scopes token, a
one-scope token, the FAILED filter and a page deep in the list. Target: under 100 ms p95 each.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import asyncpg

from stepstone.bench.common import BenchContext, Metric, bench_database, bench_queries, percentile, seed_waiting
from stepstone.bench.workflows import waiting
from stepstone.core.pin import pin_of
from stepstone.store.factory import open_store
from stepstone.store.queries import named_queries

if TYPE_CHECKING:
    import httpx

BATCH = 200_000
QUICK_SIZE = 10_000
TASKS = 100_000
"""Open tasks seeded on the instances (at most one each: all of them at --quick size)."""
TARGET_MS = 100.0
Call = Callable[[], Awaitable[None]]


async def run(ctx: BenchContext) -> list[Metric]:
    size = ctx.sizes.scale_large if ctx.sizes.name == "full" else QUICK_SIZE
    async with bench_database(ctx) as url:
        conn = await asyncpg.connect(url)
        try:
            started = time.monotonic()
            pin = pin_of(waiting)
            for lo in range(1, size + 1, BATCH):
                async with conn.transaction():
                    await seed_waiting(conn, ctx.schema, pin, lo, min(size, lo + BATCH - 1))
            await conn.execute(named_queries("bench_api.sql", ctx.schema)["api_bench_spread"])
            tasks = min(TASKS, size)
            await conn.execute(named_queries("bench_api.sql", ctx.schema)["api_bench_tasks"], tasks)
            await conn.execute(bench_queries(ctx.schema)["analyze"])
            ctx.say(f"api: seeded {size:,} instances and {tasks:,} open tasks in {time.monotonic() - started:.0f} s")
        finally:
            await conn.close()
        # The api extra (FastAPI, httpx) only when this workload runs: `stepstone bench` works without it.
        import httpx  # noqa: PLC0415

        from stepstone.api.app import create_app  # noqa: PLC0415
        from stepstone.api.hosting import context_on  # noqa: PLC0415
        from stepstone.api.tokens import create_token  # noqa: PLC0415

        store = await open_store(url, ctx.schema, max_size=4)
        api = context_on(store)
        try:
            everyone, _ = await create_token(api.management, role="viewer")
            acme, _ = await create_token(api.management, role="viewer", scope="acme")
            mia, _ = await create_token(api.management, role="task_worker", name="mia")
            transport = httpx.ASGITransport(app=create_app(api))
            async with httpx.AsyncClient(transport=transport, base_url="http://bench") as http:
                return await _measure(ctx, http, everyone, acme, mia, 200 if ctx.sizes.name == "full" else 40)
        finally:
            await api.close()
            await store.close()


async def _measure(
    ctx: BenchContext, http: httpx.AsyncClient, everyone: str, acme: str, mia: str, requests: int,
) -> list[Metric]:
    async def page(token: str, **params: str) -> dict[str, object]:
        r = await http.get("/api/v1/instances", params={"limit": "50", **params},
                           headers={"Authorization": f"Bearer {token}"})
        r.raise_for_status()
        body: dict[str, object] = r.json()
        return body

    cursor: object = None
    for _ in range(20):  # twenty pages in: the keyset costs the same as the first page
        body = await page(everyone, **({"cursor": str(cursor)} if cursor else {}))
        cursor = body["next_cursor"]
    deep = {"cursor": str(cursor)}
    cases = {"list, all scopes": (everyone, {}), "list, one scope": (acme, {}),
             "list, FAILED only": (everyone, {"status": "FAILED"}), "list, page 21": (everyone, deep)}
    def get(path: str, headers: dict[str, str], params: dict[str, str] | None = None) -> Call:
        # A page of 50 where the route takes a limit (the counts take none: an unknown parameter is a 422).
        paged = {"limit": "50"} if path in ("/api/v1/instances", "/api/v1/tasks") else {}

        async def call() -> None:
            (await http.get(path, headers=headers, params={**paged, **(params or {})})).raise_for_status()

        return call

    def bearer(token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    calls = {name: get("/api/v1/instances", bearer(token), params) for name, (token, params) in cases.items()}
    calls["counts, all scopes"] = get("/api/v1/instances/counts", bearer(everyone))
    calls["counts, one scope"] = get("/api/v1/instances/counts", bearer(acme))
    calls["UI list page (list and counts)"] = get("/ui/", {"Cookie": f"stepstone_token={everyone}"})
    calls["inbox, my assigned tasks"] = get("/api/v1/tasks", bearer(mia), {"mode": "assigned"})
    calls["inbox, every open task"] = get("/api/v1/tasks", bearer(mia), {"mode": "all"})
    calls["inbox, every open task of one scope"] = get("/api/v1/tasks", bearer(acme), {"mode": "all"})
    calls["inbox count, every open task"] = get("/api/v1/tasks/count", bearer(mia), {"mode": "all"})
    metrics = []
    for name, call in calls.items():
        times = []
        for _ in range(requests):
            started = time.perf_counter()
            await call()
            times.append((time.perf_counter() - started) * 1000)
        p95 = percentile(times, 95)
        assert p95 is not None
        ctx.say(f"api: {name}: p50 {percentile(times, 50):.1f} ms, p95 {p95:.1f} ms")
        metrics.append(Metric("api", f"p95 {name}", p95, "ms", target=f"< {TARGET_MS:g} ms", met=p95 < TARGET_MS))
    return metrics
