"""No named query of the store reads a whole queue index to find a few commands, on the plans a database
analyzed with an empty queue gives it (docs/performance-history.md, "Lookups by id"). `generic_plans.py` is the
audit; this runs it over every named query, so a new one is checked without a workload that sends it."""

from __future__ import annotations

import asyncpg

from stepstone.bench.common import bench_queries
from stepstone.bench.workflows import registry, three
from stepstone.client import Client
from stepstone.runtime.worker import Worker
from stepstone.store.postgres import PostgresStore
from tests.perf.generic_plans import whole_index_reads

# Operators' reads that want every deferred or dead command: for them the partial index is the read.
# And an idle worker's wake-up, which wants every claimed command (the ones in flight) to find the
# earliest lease expiry, a position's (migration 0030), and the probe's busy work, which wants every one too
# (through commands_leased alone: the assertion below).
WANT_THE_WHOLE_QUEUE = {
    ("queries.sql", "next_available"),
    ("operations.sql", "busy_commands"),
    ("management.sql", "dead_commands_page"),
    ("schedules.sql", "delete_flow_limit"),
    ("health.sql", "deferred_pins"),
    ("registry.sql", "resume_deferred"),
    ("functions", "stranded"),
}

# The claim's one read for its routes when nothing is routed (migration 0084): the first entry of the index of
# routed ready commands (is anything routed?), LIMIT 1, with no condition by design.
FIRST_ENTRY = {("functions", "claim_heads", "commands_routed, condition None, filter None")}


async def test_no_lookup_reads_a_whole_queue_index(database_url: str) -> None:
    store = await PostgresStore.open(database_url, "stepstone", max_size=2)
    try:
        client = Client(store, registry)
        worker = Worker(store, registry)
        await worker.register()
        await client.start_many(three, [{} for _ in range(1_000)])
        await worker.run_until_idle()  # thousands of rows in every table, none of them queued
    finally:
        await store.close()
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(bench_queries("stepstone")["analyze"])
        found = [f for f in await whole_index_reads(conn, "stepstone") if f not in FIRST_ENTRY]
    finally:
        await conn.close()
    assert [f for f in found if f[:2] not in WANT_THE_WHOLE_QUEUE] == []
    assert {f[:2] for f in found} <= WANT_THE_WHOLE_QUEUE
    assert {f[2].split(",")[0] for f in found if f[1] == "busy_commands"} == {"commands_leased"}
