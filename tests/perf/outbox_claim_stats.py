"""The relay's claim on an outbox that grew before any ANALYZE, of whichever stepstone is importable.

Not a test (pytest does not collect it): the harness behind "The outbox claim on any statistics" in
docs/performance-history.md. On a fresh database (on the server at --admin-url) it stages --events events in one
insert (keys cycling over --keys keys, as the bench stages them), then claims --limit events --claims times
without ANALYZE, publishing each batch (as a relay does), and prints the p50/max of those claims; then it
analyzes the outbox and does the same again. With --plan it prints the first claim's plan of each phase.
With --held N it first stages one event of key 'held', dead-lettered, and N events of that key behind it
(older than the others): a key held back with a backlog that no claim may take.

    python tests/perf/outbox_claim_stats.py --events 100000 --keys 1000 --limit 50
    python tests/perf/outbox_claim_stats.py --events 10000 --held 100000

For an A/B, run it on each tree alternately, the other tree's `src` first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import asyncpg
from scratch_database import scratch_database  # a sibling: see scratch_database.py

from stepstone.store.migrate import migrate
from stepstone.store.outbox import PostgresOutbox, Settlement
from stepstone.store.postgres import PostgresStore

SCHEMA = "stepstone"
STAGE = f"""INSERT INTO {SCHEMA}.outbox (event_id, instance_id, type, key, payload, created_at)
SELECT gen_random_uuid(), gen_random_uuid(), 'bench.event', 'k' || (g % $2), jsonb_build_object('n', g), now()
FROM generate_series(1, $1) AS g"""
HELD = f"""INSERT INTO {SCHEMA}.outbox (event_id, instance_id, type, key, payload, created_at, dead_at)
SELECT gen_random_uuid(), gen_random_uuid(), 'bench.event', 'held', jsonb_build_object('n', g), now(),
       CASE WHEN g = 0 THEN now() END
FROM generate_series(0, $1) AS g"""


async def claims(outbox: PostgresOutbox, conn: asyncpg.Connection, n: int, limit: int, plan: bool) -> list[float]:
    """`n` claims of `limit`, each batch published before the next; the milliseconds of each claim."""
    if plan:  # one claim's plans (its statement's, and the function's inside it), rolled back
        for setting in ("LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0",
                        "SET auto_explain.log_analyze = on", "SET auto_explain.log_nested_statements = on",
                        "SET auto_explain.log_level = notice"):
            await conn.execute(setting)
        def show(_: object, message: asyncpg.PostgresLogMessage) -> None:
            if "WITH cand" in message.message:  # the claim's own statement, not db_now's
                print(message.message)  # noqa: T201

        conn.add_log_listener(show)
        tr = conn.transaction()
        await tr.start()
        await conn.fetch(outbox.q["outbox_claim"], limit, 30.0, "plan", uuid.uuid4())
        await tr.rollback()
        conn.remove_log_listener(show)
        await conn.reset()
    times = []
    for _ in range(n):
        token = uuid.uuid4()
        t0 = time.perf_counter()
        batch = await outbox.claim(limit, 30.0, "probe", token)
        times.append((time.perf_counter() - t0) * 1000)
        assert len(batch) == limit, f"claimed {len(batch)} of {limit}"
        await outbox.settle(token, [Settlement(e.id, "published") for e in batch])
    return times


def summary(label: str, times: list[float]) -> None:
    print(f"{label}: p50 {statistics.median(times):.1f} ms, max {max(times):.1f} ms, first {times[0]:.1f} ms "  # noqa: T201
          f"over {len(times)} claims")


async def run(args: argparse.Namespace) -> None:
    async with scratch_database(args.admin_url, "outbox_stats") as url:
        conn = await asyncpg.connect(url)
        await migrate(conn, SCHEMA)
        store = await PostgresStore.open(url, SCHEMA, max_size=2)
        try:
            outbox = PostgresOutbox(store)
            if args.held:
                await conn.execute(HELD, args.held)
            await conn.execute(STAGE, args.events, args.keys)
            summary("before ANALYZE", await claims(outbox, conn, args.claims, args.limit, args.plan))
            await conn.execute(f"ANALYZE {SCHEMA}.outbox")
            summary("after ANALYZE ", await claims(outbox, conn, args.claims, args.limit, args.plan))
        finally:
            await conn.close()
            await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--keys", type=int, default=1_000)
    parser.add_argument("--limit", type=int, default=50)
    parser.add_argument("--claims", type=int, default=20)
    parser.add_argument("--plan", action="store_true")
    parser.add_argument("--held", type=int, default=0, metavar="N",
                        help="first a dead event of key 'held' with N events of that key behind it")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
