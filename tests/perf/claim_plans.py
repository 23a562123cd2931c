"""Claims on a worker's connection that first claimed while the database was small, of whichever stepstone
is importable.

Not a test (pytest does not collect it): the harness behind "The claim on its generic plan" in
docs/performance-history.md. PostgreSQL keeps a prepared statement's generic plan only while it costs less than
the average of every custom plan the connection made for it; a claim's estimated cost grows with the
queue, so a connection whose first claims found small tables could plan each claim anew once the tables
had grown and been analyzed. Two modes, each on a fresh database on the server at --admin-url:

    python tests/perf/claim_plans.py empty --waiting 100000   # p50 of 200 empty claims, after growth
    python tests/perf/claim_plans.py drain --backlog 20000    # an idle worker drains a backlog
    python tests/perf/claim_plans.py served --backlog 20000   # claims of one workflow behind another's
    python tests/perf/claim_plans.py names --backlog 5000     # claims naming 1 to 1,000 served workflows
    python tests/perf/claim_plans.py stale --backlog 20000    # served's claims, planned on an empty queue

`empty`: a store claims ten times on the empty database, then --waiting instances are seeded (as the
scale bench seeds them) and analyzed, and the same store claims 200 times more (finding nothing).
`empty` also prints the claim statement's plans on the store's kept connection (`pg_prepared_statements`;
from migration 0036 on that statement is the call of `claim_heads`, whose own statement always runs on
its generic plan). `drain`: an in-process worker of 8 slots runs 20 workflows one at a time, then
--backlog three-step workflows are started in one batch and analyzed (as autovacuum would), and the
drain is timed. `served`: --backlog starts of one workflow are queued, then 400 of another after them,
and a store that serves only the second claims them 8 at a time (the claim of a worker that serves
some workflows; "A worker that serves some workflows" in docs/performance-history.md): p50 and p90 of its
claims, and the same for a store that serves every workflow, first with the backlog and the 400 queued,
then with 400 more of every workflow queued. `names`: --backlog starts of one workflow queued, and claims of 8
that name no definitions, or it and 0, 4, 99 or 999 more that have no work (a worker serving that many
workflows probes each one's queue). `stale`: as `served`, but the tables were last analyzed when the
queue was empty (after 50 workflows ran to the end), and not after the backlog arrived, so the claims run
on plans that think every queue index is free to read whole ("Ready commands indexed once"). For an A/B,
run it on each tree alternately, the other tree's `src` first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator

import asyncpg
from scratch_database import scratch_database  # a sibling: see scratch_database.py

from stepstone.bench.scale import seed
from stepstone.bench.workflows import registry, three, waiting
from stepstone.client import Client
from stepstone.core.pin import pin_of
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.migrate import migrate
from stepstone.store.postgres import PostgresStore

SCHEMA = "stepstone"
PLANS = """SELECT custom_plans, generic_plans FROM pg_prepared_statements
WHERE (statement LIKE '%claim_heads(%' OR statement LIKE '-- Claim up to%')
  AND statement NOT LIKE '%pg_prepared_statements%'"""


async def planned(store: PostgresStore) -> str:
    """The claim statement's plans on the store's kept connection, which made every claim of `empty`."""
    rows = await store._kept.fetch(PLANS)
    return ", ".join(f"{r['custom_plans']} custom and {r['generic_plans']} generic plans" for r in rows)


@contextlib.asynccontextmanager
async def opened(url: str, max_size: int) -> AsyncIterator[tuple[asyncpg.Connection, PostgresStore, Worker]]:
    """A connection, a store and a registered (not started) worker of the bench's workflows."""
    conn = await asyncpg.connect(url)
    store = await PostgresStore.open(url, SCHEMA, max_size=max_size)
    try:
        worker = Worker(store, registry, WorkerConfig(concurrency=4, worker_id="probe"))
        await worker.register()
        yield conn, store, worker
    finally:
        await store.close()
        await conn.close()


async def empty(url: str, size: int) -> None:
    async with opened(url, 2) as (conn, store, worker):
        for _ in range(10):
            await store.claim(8, 30.0, "probe", worker.served)
        await seed(conn, SCHEMA, pin_of(waiting), 1, size)  # and analyzed, as the scale bench does
        took = []
        for _ in range(200):
            began = time.perf_counter()
            assert await store.claim(8, 30.0, "probe", worker.served) == []
            took.append(time.perf_counter() - began)
        print(f"  {await planned(store)}")  # noqa: T201
        print(f"empty claim at {size:,} waiting: p50 {statistics.median(took) * 1e3:.2f} ms")  # noqa: T201


class Ended:
    """Counts the instances that end, as the store's settled channel announces them."""

    def __init__(self) -> None:
        self.count = 0
        self.changed = asyncio.Event()

    def __call__(self, _instance_id: str) -> None:
        self.count += 1
        self.changed.set()

    async def reach(self, count: int) -> None:
        while self.count < count:
            self.changed.clear()
            await self.changed.wait()


async def drain(url: str, backlog: int) -> None:
    conn = await asyncpg.connect(url)
    store = await PostgresStore.open(url, SCHEMA, max_size=12)
    client_store = await PostgresStore.open(url, SCHEMA, max_size=4)
    ended = Ended()
    listener = await client_store.listen_settled(ended)
    worker = Worker(store, registry, WorkerConfig(concurrency=8, worker_id="drain"))
    await worker.start()
    try:
        client = Client(client_store, registry)
        for n in range(1, 21):  # an idle worker's claims: they see small tables
            await client.start(three, {})
            await ended.reach(n)
        await client.start_many(three, [{} for _ in range(backlog)])
        await conn.execute("ANALYZE")
        began = time.monotonic()
        await ended.reach(20 + backlog)
        rate = backlog / (time.monotonic() - began)
        print(f"drained {backlog:,}: {rate:.0f} workflows/s")  # noqa: T201
    finally:
        await worker.stop()
        await listener.close()
        await store.close()
        await client_store.close()
        await conn.close()


async def served(url: str, backlog: int) -> None:
    async with opened(url, 4) as (conn, store, worker):
        client = Client(store, registry)
        await client.start_many(three, [{} for _ in range(backlog)])
        await client.start_many(waiting, [{} for _ in range(400)])
        await conn.execute("ANALYZE")
        behind = f"behind {backlog:,} of another workflow"
        await claims(store, f"serving one workflow, {behind}", [waiting.plan.definition_id])
        await claims(store, f"serving all, {behind}", worker.served)
        for wf in registry:  # every served workflow has ready work: each one's walk locks up to 8 positions
            await client.start_many(wf, [{} for _ in range(400)])
        await conn.execute("ANALYZE")
        await claims(store, f"serving all ({len(worker.served)}), each with 400 queued, {behind}", worker.served)


async def stale(url: str, backlog: int) -> None:
    async with opened(url, 4) as (conn, store, worker):
        client = Client(store, registry)
        await client.start_many(three, [{} for _ in range(50)])
        await worker.run_until_idle()
        await conn.execute("ANALYZE")  # the queue is empty now
        await client.start_many(three, [{} for _ in range(backlog)])
        await client.start_many(waiting, [{} for _ in range(800)])
        behind = f"behind {backlog:,} of another workflow, planned on an empty queue"
        await claims(store, f"serving one workflow, {behind}", [waiting.plan.definition_id])
        await claims(store, f"serving all, {behind}", worker.served)


async def names(url: str, backlog: int) -> None:
    async with opened(url, 2) as (conn, store, _worker):
        await Client(store, registry).start_many(three, [{} for _ in range(backlog)])
        await conn.execute("ANALYZE")
        for count in (None, 1, 5, 100, 1000):
            served = None if count is None else [three.plan.definition_id, *(f"other_{n}" for n in range(count - 1))]
            await claims(store, f"{backlog:,} queued, naming {count or 'no'} definitions", served)


async def claims(store: PostgresStore, label: str, definitions: list[str] | None) -> None:
    took = []
    for _ in range(50):
        began = time.perf_counter()
        assert len(await store.claim(8, 30.0, "probe", definitions)) == 8
        took.append(time.perf_counter() - began)
    p90 = statistics.quantiles(took, n=10)[-1]
    print(f"claim of 8, {label}: "  # noqa: T201
          f"p50 {statistics.median(took) * 1e3:.2f} ms, p90 {p90 * 1e3:.2f} ms")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["empty", "drain", "served", "names", "stale"])
    parser.add_argument("--waiting", type=int, default=100_000, help="instances seeded (empty)")
    parser.add_argument("--backlog", type=int, default=20_000,
                        help="workflows started at once (drain, served, names, stale)")
    parser.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    async with scratch_database(args.admin_url, "stepstone_claims") as url:
        conn = await asyncpg.connect(url)
        try:
            await migrate(conn, SCHEMA)
        finally:
            await conn.close()
        if args.mode == "empty":
            await empty(url, args.waiting)
        else:
            await {"drain": drain, "served": served, "names": names, "stale": stale}[args.mode](url, args.backlog)


if __name__ == "__main__":
    asyncio.run(main())
