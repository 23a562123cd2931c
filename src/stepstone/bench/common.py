"""What the workloads share: sizes, a fresh database per workload, instrumentation and statistics."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from stepstone.core.effects import MovePosition
from stepstone.core.model import Decision
from stepstone.store.migrate import migrate
from stepstone.store.port import Claim, CommitRequest, Committed, Pin, Store
from stepstone.store.postgres import PostgresStore
from stepstone.store.queries import named_queries
from stepstone.store.sqlfiles import render_identifier

__all__ = [
    "BenchContext",
    "Metric",
    "Progress",
    "Sizes",
    "StatementLog",
    "bench_database",
    "bench_queries",
    "percentile",
    "seed_waiting",
    "track_commits",
]

def bench_queries(schema: str) -> dict[str, str]:
    """The named queries of `store/sql/bench.sql`, read by the store's loader."""
    return named_queries("bench.sql", schema)


@dataclass(frozen=True)
class Sizes:
    """How big each workload runs: `quick` for CI, `full` for the numbers in docs/performance.md."""

    name: str
    ceiling_seconds: float
    ceiling_instances: int
    workflows: int
    latency_seconds: float
    signal_samples: int
    enqueue: int
    scale_small: int
    scale_large: int
    scale_workflows: int
    recovery_instances: int
    memory_in_flight: int
    fanout_branches: int = 10
    fanout_seconds: float = 1.0
    fanout_repeats: int = 3
    map_items: int = 1_000
    batch_starts: int = 100_000

    @classmethod
    def quick(cls) -> Sizes:
        return cls("quick", 5, 2_000, 600, 5, 30, 500, 1_000, 50_000, 300, 20, 1_000,
                   fanout_repeats=1, map_items=200, batch_starts=20_000)

    @classmethod
    def full(cls) -> Sizes:
        return cls("full", 15, 10_000, 5_000, 20, 200, 3_000, 1_000, 1_000_000, 2_000, 100, 1_000)


@dataclass
class Metric:
    """One reported number, with its target when the issue sets one."""

    workload: str
    name: str
    value: float | None
    unit: str
    target: str | None = None
    met: bool | None = None
    ratio: float | None = None
    """Throughputs only: value / the same-run pgbench ceiling."""
    note: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class BenchContext:
    """Settings every workload receives."""

    admin_url: str
    schema: str
    sizes: Sizes
    concurrency: int
    processes: int
    bin_dir: str
    ceiling: float | None = None
    serial_ceiling: float | None = None
    """The ceiling's script from one client: the floor for one-at-a-time work (`ceiling.py`)."""
    max_workflows_per_s: float | None = None
    log: list[str] = field(default_factory=list)

    def say(self, text: str) -> None:
        self.log.append(text)
        print(f"  {text}", flush=True)  # noqa: T201 - progress of a long-running command


def database_url(url: str, database: str) -> str:
    """`url` pointing at another database on the same server."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{database}", parts.query, parts.fragment))


@asynccontextmanager
async def bench_database(ctx: BenchContext) -> AsyncIterator[str]:
    """A fresh, migrated database `stepstone_bench_<random>`, dropped afterwards; yields its URL."""
    name = f"stepstone_bench_{uuid.uuid4().hex[:10]}"
    q = bench_queries(ctx.schema)
    admin = await asyncpg.connect(ctx.admin_url)
    try:
        await admin.execute(render_identifier(q["create_database"], "database", name))
    finally:
        await admin.close()
    url = database_url(ctx.admin_url, name)
    try:
        conn = await asyncpg.connect(url)
        try:
            await migrate(conn, ctx.schema)
        finally:
            await conn.close()
        yield url
    finally:
        admin = await asyncpg.connect(ctx.admin_url)
        try:
            await admin.execute(render_identifier(q["drop_database"], "database", name))
        finally:
            await admin.close()


class StatementLog:
    """Counts and times the statements a store sends, by query name (wraps `_fetch*` on one store).

    It times the PostgreSQL adapter's own statements, so it takes a `PostgresStore`, the one place
    outside `stepstone.store` that opens the adapter by its type instead of through `open_store`.
    """

    def __init__(self, store: PostgresStore) -> None:
        self.calls: list[tuple[str, float]] = []
        for method in ("_fetch", "_fetchrow", "_fetchval"):
            setattr(store, method, self._wrap(getattr(store, method)))

    def _wrap(self, inner: Any) -> Any:
        async def timed(name: str, *args: Any) -> Any:
            started = time.perf_counter()
            try:
                return await inner(name, *args)
            finally:
                self.calls.append((name, time.perf_counter() - started))

        return timed

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.calls if n == name)

    def seconds(self, name: str) -> list[float]:
        return [s for n, s in self.calls if n == name]

    def clear(self) -> None:
        self.calls.clear()


class Progress:
    """Instances that finished, with the monotonic time each one did; waiters wake on every change."""

    def __init__(self) -> None:
        self.ended: dict[str, float] = {}
        self.waiting: dict[str, float] = {}
        self.changed = asyncio.Condition()
        self.done = 0

    async def bump(self, instance_id: str | None = None, *, ended: bool = True, count: int = 1) -> None:
        now = time.monotonic()
        async with self.changed:
            if instance_id is not None:
                (self.ended if ended else self.waiting)[instance_id] = now
            if ended:
                self.done += count
            self.changed.notify_all()

    async def wait_until(self, predicate: Any, timeout: float) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(predicate), timeout)


def track_commits(store: Store, progress: Progress) -> None:
    """Record in `progress` when a commit on `store` (single or grouped) ended an instance or made it wait."""
    inner_one, inner_many = store.commit, store.commit_many

    async def record(claim: Claim, decision: Decision, result: Committed | None) -> None:
        if result is not None and not result.conflict:
            move = decision.first(MovePosition)
            if decision.ended:
                await progress.bump(claim.instance.id)
            elif move is not None and move.status == "WAITING":
                await progress.bump(claim.instance.id, ended=False)

    async def commit_many(requests: list[CommitRequest], **kwargs: Any) -> list[Committed | None]:
        results = await inner_many(requests, **kwargs)
        for request, result in zip(requests, results, strict=True):
            await record(request.claim, request.decision, result)
        return results

    async def commit(request: CommitRequest, **kwargs: Any) -> Committed | None:
        result = await inner_one(request, **kwargs)
        await record(request.claim, request.decision, result)
        return result

    store.commit = commit  # type: ignore[method-assign]
    store.commit_many = commit_many  # type: ignore[method-assign]


async def seed_waiting(conn: asyncpg.Connection, schema: str, pin: Pin, first: int, last: int) -> None:
    """Bulk-insert waiting instances first..last as the engine writes them (see bench.sql)."""
    q = bench_queries(schema)
    await conn.execute(q["seed_waiting_instances"], first, last, pin.definition_id, pin.version, pin.plan_hash)
    await conn.execute(q["seed_waiting_positions"], first, last)
    await conn.execute(q["seed_waiting_commands"], first, last)
    await conn.execute(q["seed_waiting_history"], first, last)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[max(0, min(998, round(q * 10) - 1))]
