"""EXPLAIN guards: the claim and commit-path statements use indexes, never a Seq Scan on commands or
instances, with enough rows that the planner would seq-scan if an index were missing.

Plans are captured from the real statements as they run (the claim named query and every statement
inside `commit_segment`) with auto_explain, sent to the client as NOTICEs.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any, ClassVar

import asyncpg
import pytest

from stepstone.authoring.workflow import Registry
from stepstone.bench.common import bench_queries, seed_waiting
from stepstone.bench.workflows import fanout, registry, signal_wf, three, waiting
from stepstone.client import Client
from stepstone.core.pin import pin_of
from stepstone.runtime import serving
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store import postgres
from stepstone.store.database import create_pool
from stepstone.store.postgres import PostgresStore
from stepstone.store.queries import named_queries, queries
from tests._pg import PgServer
from tests.perf.generic_plans import function_statement, reads_whole_index, scans_over
from tests.perf.generic_plans import plan_nodes as _nodes

WAITING = 20_000
GUARDED = {"commands", "instances", "positions"}




def seq_scans(plans: list[dict[str, Any]]) -> list[str]:
    """'<relation>: <query text>' for every Seq Scan on a guarded table in the captured plans."""
    return [
        f"{node['Relation Name']}: {' '.join(entry.get('Query Text', '').split())[:200]}"
        for entry in plans
        for node in _nodes(entry["Plan"])
        if node.get("Node Type") == "Seq Scan" and node.get("Relation Name") in GUARDED
    ]


async def _seed(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        await seed_waiting(conn, "stepstone", pin_of(waiting), 1, WAITING)
        await conn.execute(bench_queries("stepstone")["analyze"])
    finally:
        await conn.close()


async def _explain_everything(database_url: str, *, verbose: bool = False) -> None:
    """auto_explain on for every session of the database (database settings are not cloned with it);
    `verbose` adds each node's output columns."""
    conn = await asyncpg.connect(database_url)
    try:
        database = await conn.fetchval("SELECT current_database()")
        for setting in (
            "session_preload_libraries = 'auto_explain'",
            "auto_explain.log_min_duration = 0",
            "auto_explain.log_nested_statements = on",
            "auto_explain.log_format = json",
            "auto_explain.log_level = notice",
            *(["auto_explain.log_verbose = on"] if verbose else []),
        ):
            await conn.execute(f'ALTER DATABASE "{database}" SET {setting}')
    finally:
        await conn.close()


class _PlanCapture(asyncpg.Connection):  # type: ignore[misc]
    """Collects auto_explain's NOTICEs (JSON plans) into `sink` without log listeners, which the
    pool would warn about and clear on every release."""

    sink: ClassVar[list[dict[str, Any]]] = []

    def _process_log_message(self, fields: Any, last_query: Any) -> None:
        text = asyncpg.PostgresLogMessage.new(fields, query=last_query).message
        if "plan:" in text:
            self.sink.append(json.loads(text.split("plan:", 1)[1]))


async def _capturing_store(database_url: str, plans: list[dict[str, Any]]) -> PostgresStore:
    """A store whose connections put the plans auto_explain sends them into `plans`."""
    _PlanCapture.sink = plans
    pool = await create_pool(  # the store's pool: its codecs and its session settings
        database_url, min_size=1, max_size=4, init=postgres._init_connection, connection_class=_PlanCapture,
    )
    return PostgresStore(pool, database_url, "stepstone")


async def captured_plans(database_url: str) -> list[dict[str, Any]]:
    """Run three-step and signal workflows through a worker; the plans of every statement it sent."""
    plans: list[dict[str, Any]] = []
    store = await _capturing_store(database_url, plans)
    try:
        client = Client(store, registry)
        worker = Worker(store, registry, WorkerConfig(concurrency=4, worker_id="plans"))
        await worker.register()
        for _ in range(8):  # past plpgsql's five custom plans, so generic plans are seen too
            await client.start(three, {})
        waiting_ids = [await client.start(signal_wf, {}) for _ in range(3)]
        await worker.run_until_idle()
        for iid in waiting_ids:
            await client.signal(iid, "go")
        await worker.run_until_idle()
        assert [(await client.get(i)).status for i in waiting_ids] == ["COMPLETED"] * len(waiting_ids)
    finally:
        await store.close()
    return plans


@pytest.fixture(scope="module")
def seeded_template(pg_server: PgServer) -> Iterator[str]:
    """The waiting instances are seeded once and each test gets a clone: seeding and analyzing took
    4.5-7 s, once per test. Nobody (autovacuum included) may connect to it, or a clone waits."""
    name = pg_server.take_clone()
    try:
        pg_server.admin.run(_seed(pg_server.url_for(name)))
        pg_server.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
        yield name
    finally:
        pg_server.drop_database(name)


@pytest.fixture
async def seeded(pg_server: PgServer, seeded_template: str) -> AsyncIterator[str]:
    name = pg_server.create_database(template=seeded_template, prefix="seeded")
    url = pg_server.url_for(name)
    try:
        await _explain_everything(url)
        yield url
    finally:
        pg_server.drop_later(name)


def _norm(sql: str) -> str:
    return " ".join(sql.split())


async def _function_bodies(database_url: str, query: str) -> list[str]:
    """The source of the server-side functions the store's named query `query` calls, and of those they
    call in turn, as the database has them (the claim's statement is the body of `claim_heads`)."""
    called = set(re.findall(r'"stepstone"\.(\w+)\(', queries("stepstone")[query]))
    assert called, f"the {query} query calls no stepstone function"
    conn = await asyncpg.connect(database_url)
    bodies: dict[str, str] = {}
    try:
        todo = called
        while todo:
            rows = await conn.fetch(
                "SELECT proname, prosrc FROM pg_proc WHERE pronamespace = 'stepstone'::regnamespace "
                "AND proname = ANY($1)", sorted(todo),
            )
            found = {r["proname"]: r["prosrc"] for r in rows}
            bodies.update(found)
            todo = {m for body in found.values() for m in re.findall(r'"stepstone"\.(\w+)\(', body)}
            todo -= bodies.keys() | {"db_now"}
    finally:
        await conn.close()
    return [_norm(b) for b in bodies.values()]


async def test_claim_and_commit_use_indexes(seeded: str) -> None:
    """Which plans were captured is decided by the statements themselves (the claim named query as the
    store sends it; statements found in the body of the commit function), not by SQL literals here."""
    plans = await captured_plans(seeded)
    texts = [_norm(p.get("Query Text", "")) for p in plans]
    claim = await _function_bodies(seeded, "claim")
    assert any(t and any(t in body for body in claim) for t in texts), "the claim statement's plan was captured"
    bodies = await _function_bodies(seeded, "commit_many")
    nested = [t for t in texts if t and any(t in body for body in bodies)]
    assert any("positions p SET" in t for t in nested), "statements inside the commit function were captured"
    assert seq_scans(plans) == []


QUEUE_WALKS = {"commands_ready", "commands_leased"}
"""Partial indexes in available-time order: walked by the claim and by the look-up of the next due time,
read by no other statement."""

RETIRED: set[str] = set()
"""Indexes kept for the previous release's statements until their contract step: nothing of this one may read
them. Empty between contract steps (the last: commands_ready_definition, kept by migration 0041 and dropped
by 0043)."""


ROUTED = "commands_routed"
"""The routed ready commands (migration 0084), few: read by the claim, which takes the index's first entry
with no condition (is anything routed?) before it looks up its own routes in it, and by `ready_routes` (which
the claim's statement calls for a worker of an earlier release, so its source is among the claim's)."""


async def queue_walks(database_url: str) -> list[str]:
    """The statements that walk the queue indexes: the claim's (in its function) and the look-up of the next
    due time."""
    return [*await _function_bodies(database_url, "claim"), _norm(queries("stepstone")["next_available"])]


def whole_index_scans(plans: list[dict[str, Any]], walks: list[str]) -> list[str]:
    """'<index>: <query text>' for every index scan on commands that reads a whole index, or all of a queue,
    to find a few rows (docs/performance-history.md, "Lookups by id"): one with no index condition; one whose only
    condition is on `id`, the first column of the primary key alone; one through a queue walk's index by a
    statement that is not such a walk (`walks`: the sources of those that are, from `queue_walks`); any
    through a RETIRED index; any through ROUTED but by a queue walk (the claim reads it)."""
    found = []
    for entry in plans:
        text = _norm(entry.get("Query Text", ""))
        for node in _nodes(entry["Plan"]):
            walk_elsewhere = node.get("Relation Name") == "commands" and node.get("Index Name") in QUEUE_WALKS \
                and not any(text and text in walk for walk in walks)
            if node.get("Index Name") == ROUTED:
                if not any(text and text in walk for walk in walks):
                    found.append(f"{ROUTED}: {text[:200]}")
            elif reads_whole_index(node) or walk_elsewhere or node.get("Index Name") in RETIRED:
                found.append(f"{node['Index Name']}: {text[:200]}")
    return found


async def test_lookups_by_id_use_the_primary_key(seeded: str) -> None:
    """The settle of a step commit and the claim's re-check find a command by id. The seeded database was
    analyzed with no command claimed, so the partial indexes of claimed and queued commands look empty
    and cheaper than the primary key; a statement whose state test proves their predicate took one and
    read all of it on every call (93.5 µs a settle after 3,300 workflows)."""
    plans = await captured_plans(seeded)
    assert whole_index_scans(plans, await queue_walks(seeded)) == []


async def test_claims_and_commits_after_a_backlog_arrived(database_url: str) -> None:
    """The last ANALYZE saw an empty queue, then a batch of starts arrived. The claim's queue-head test
    must stay a lookup per candidate: as an anti-join its plan read the whole queue index for each
    candidate (66 ms a claim with 20,000 waiting starts, 0.9 ms as a lookup). A signal's commits (the wait
    it leaves, its timer closed) must read the queue of their own position, not all of it."""
    await _explain_everything(database_url)
    plans: list[dict[str, Any]] = []
    store = await _capturing_store(database_url, plans)
    try:
        client = Client(store, registry)
        worker = Worker(store, registry, WorkerConfig(concurrency=4, worker_id="plans"))
        await worker.register()
        for _ in range(50):
            await client.start(three, {})
        await worker.run_until_idle()
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute(bench_queries("stepstone")["analyze"])  # the queue is empty now
        finally:
            await conn.close()
        await client.start_many(three, [{} for _ in range(300)])
        plans.clear()
        for _ in range(8):  # past the five custom plans, so the generic plan is seen too
            assert len(await store.claim(8, 30.0, "plans", worker.served)) == 8
        signals = Worker(store, Registry(signal_wf), WorkerConfig(concurrency=1, worker_id="signals"))
        waiting_ids = [await client.start(signal_wf, {}) for _ in range(8)]
        await signals.run_until_idle()  # each enters its wait: the commit looks for work it was blocking
        for iid in waiting_ids:  # one at a time: the commits that leave the wait close its timer
            await client.signal(iid, "go")
            await signals.run_until_idle()
        assert [(await client.get(i)).status for i in waiting_ids] == ["COMPLETED"] * len(waiting_ids)
        branches = Worker(store, Registry(fanout), WorkerConfig(concurrency=4, worker_id="branches"))
        fans = [await client.start(fanout, {"items": [0] * 4}) for _ in range(3)]
        await branches.run_until_idle()  # forks, branch commits and joins
        assert [(await client.get(i)).status for i in fans] == ["COMPLETED"] * len(fans)
    finally:
        await store.close()
    claim = await _function_bodies(database_url, "claim")
    texts = [_norm(p.get("Query Text", "")) for p in plans]
    assert any(t and any(t in body for body in claim) for t in texts), "the claim's plans were captured"
    assert whole_index_scans(plans, await queue_walks(database_url)) == []


async def _heartbeat_plans(database_url: str) -> list[dict[str, Any]]:
    """The plans of what a worker's heartbeat sends: its pins, and the look-up of commands deferred for
    want of a plan (registry.sql, resume_deferred), 8 times (past the five custom plans)."""
    plans: list[dict[str, Any]] = []
    store = await _capturing_store(database_url, plans)
    try:
        pins = serving.served_pins(registry)
        for _ in range(8):
            await serving.announce(store.definitions, "plans", pins)
    finally:
        await store.close()
    resume = _norm(named_queries("registry.sql", "stepstone")["resume_deferred"])
    assert any(_norm(p.get("Query Text", "")) == resume for p in plans), "the heartbeat's plans were captured"
    return plans


async def test_the_heartbeat_reads_no_queue(seeded: str) -> None:
    """Every worker looks for commands deferred for want of a plan at each heartbeat. Through the first
    commands_ready (available_at, id) it read every waiting instance's pending timer to keep none (49 ms at
    200,000 waiting instances; at a million the plan read every instance instead, 1.6 s a call);
    commands_not_runnable holds only such commands (migration 0033)."""
    assert await _heartbeat_reads(seeded) == []


async def _heartbeat_reads(database_url: str) -> list[str]:
    """What the heartbeat's statements read whole: queue indexes, and guarded tables scanned row by row."""
    plans = await _heartbeat_plans(database_url)
    return whole_index_scans(plans, await queue_walks(database_url)) + seq_scans(plans)


async def test_heartbeat_guard_fails_without_its_index(seeded: str) -> None:
    conn = await asyncpg.connect(seeded)
    try:
        await conn.execute('DROP INDEX "stepstone".commands_not_runnable')
    finally:
        await conn.close()
    # Without it the look-up reads a whole queue index, or (since commands_ready holds only the walks' entries,
    # migration 0041) every instance to find the pins' ones.
    assert await _heartbeat_reads(seeded)


async def test_guard_fails_without_the_claim_indexes(seeded: str) -> None:
    conn = await asyncpg.connect(seeded)
    try:
        await conn.execute(
            'DROP INDEX "stepstone".commands_ready, "stepstone".commands_position_queue'
        )
        await conn.execute('ANALYZE "stepstone".commands')
    finally:
        await conn.close()
    found = seq_scans(await captured_plans(seeded))
    # Without them the claim falls back to a Seq Scan (on commands, or positions driving the join).
    assert found and all(s.split(":")[0] in GUARDED for s in found), found


async def test_no_statement_is_compiled_by_jit(seeded: str) -> None:
    """With a million waiting instances the claim's estimated cost passed jit_above_cost and each claim
    spent ~55 ms compiling (docs/performance-history.md, "Scale, round 2"); the threshold is lowered to 0 here
    so that every plan passes it, as the claim's did: the store's connections must compile none."""
    conn = await asyncpg.connect(seeded)
    try:
        if not await conn.fetchval("SELECT pg_jit_available()"):
            pytest.skip("this PostgreSQL has no JIT (built without LLVM): no statement can be compiled")
        database = await conn.fetchval("SELECT current_database()")
        await conn.execute(f'ALTER DATABASE "{database}" SET jit_above_cost = 0')
    finally:
        await conn.close()
    plans = await captured_plans(seeded)
    assert plans, "plans were captured"
    assert [_norm(p.get("Query Text", ""))[:120] for p in plans if "JIT" in p] == []


@pytest.mark.parametrize("served", [None, ["bench_three"]], ids=["all definitions", "served definitions"])
async def test_the_claim_keeps_its_generic_plan_as_the_queue_grows(database_url: str, served: list[str] | None) -> None:
    """PostgreSQL keeps a prepared statement's generic plan only while it costs less than the average of
    the custom plans the connection ever made for it, and a claim's estimated cost grows with the queue:
    a connection whose first claims found the queue empty planned every claim anew (about 1 ms each) once
    a backlog had arrived and been analyzed (docs/performance-history.md, "The claim on its generic plan"). The
    claim's function runs it on its generic plan, whose clock CTE outputs the claim's parameters where a
    custom plan outputs their values."""
    await _explain_everything(database_url, verbose=True)
    plans: list[dict[str, Any]] = []
    store = await _capturing_store(database_url, plans)
    try:
        await Worker(store, registry).register()
        for _ in range(10):  # an idle worker's claims: past the five custom plans, on an empty queue
            assert await store.claim(8, 30.0, "plans", served) == []
        await Client(store, registry).start_many(three, [{} for _ in range(3_000)])
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute(bench_queries("stepstone")["analyze"])
        finally:
            await conn.close()
        plans.clear()
        for _ in range(3):
            assert len(await store.claim(8, 30.0, "plans", served)) == 8
    finally:
        await store.close()
    clocks = [node.get("Output", []) for p in plans for node in _nodes(p["Plan"])
              if node.get("Subplan Name") == "CTE clock"]
    assert len(clocks) == 3, clocks
    assert all(any(o.startswith("$") for o in out) for out in clocks), clocks


async def test_a_claim_serving_one_workflow_reads_none_of_another_ones_backlog(database_url: str) -> None:
    """A worker serving some workflows walked every workflow's ready commands in time order and looked up
    each one's instance to keep its own: behind 20,000 queued starts of another workflow a claim took
    26 ms (tests/perf/claim_plans.py served). It walks each served definition's own ready commands now
    (commands_ready by definition, migrations 0038-0042): no scan of `commands` in its plan touches the
    other workflow's 3,000 queued starts."""
    store = await PostgresStore.open(database_url, "stepstone", max_size=2)
    try:
        await Worker(store, registry).register()
        client = Client(store, registry)
        await client.start_many(three, [{} for _ in range(3_000)])
        await client.start_many(waiting, [{} for _ in range(20)])
    finally:
        await store.close()
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(bench_queries("stepstone")["analyze"])
        await conn.execute(f"PREPARE claim AS {await function_statement(conn, 'claim_heads')}")
        async with conn.transaction():
            plan = json.loads(await conn.fetchval(
                f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE claim(8, 30.0, 'plans', ARRAY['{waiting.plan.definition_id}'])"
            ))[0]["Plan"]
            claimed = await conn.fetch("SELECT i.definition_id FROM stepstone.instances i JOIN stepstone.commands c"
                                       " ON c.instance_id = i.id WHERE c.state = 'CLAIMED'")
    finally:
        await conn.close()
    assert [r["definition_id"] for r in claimed] == [waiting.plan.definition_id] * 8
    assert scans_over(plan, "commands", 100) == set()


async def test_a_claim_with_nothing_routed_reads_one_entry_of_the_routed_index(database_url: str) -> None:
    """A worker names the route of each pin it has after its definition ids (migration 0076); its claim
    probed commands_ready for each route, empty unless something was deferred. Behind 3,000 queued starts
    and with nothing routed, the claim's one read for its routes is the first entry of commands_routed
    (migrations 0084-0085), which it finds empty, and its walk probes commands_ready for the five ids alone."""
    store = await PostgresStore.open(database_url, "stepstone", max_size=2)
    try:
        worker = Worker(store, registry)
        await worker.register()
        await Client(store, registry).start_many(three, [{} for _ in range(3_000)])
    finally:
        await store.close()
    keys = ", ".join(f"'{k}'" for k in worker.served)
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(bench_queries("stepstone")["analyze"])
        await conn.execute(f"PREPARE claim AS {await function_statement(conn, 'claim_heads')}")
        async with conn.transaction():
            plan = json.loads(await conn.fetchval(
                f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE claim(8, 30.0, 'plans', ARRAY[{keys}])"))[0]["Plan"]
    finally:
        await conn.close()
    assert len(worker.served) == 10
    routed = [(n["Node Type"], n["Actual Loops"]) for n in _nodes(plan) if n.get("Index Name") == "commands_routed"]
    assert sorted(routed) == [("Index Only Scan", 0), ("Index Only Scan", 1)]  # anything routed? then its own
    probes = max(n["Actual Loops"] for n in _nodes(plan) if n.get("Index Name") == "commands_ready")
    assert probes == len(registry.definition_ids) == 5
    assert not [n for n in _nodes(plan) if n["Node Type"] == "Seq Scan" and n.get("Relation Name") == "commands"]


async def test_the_routes_with_ready_work_are_found_in_their_own_index(database_url: str) -> None:
    """`ready_routes` (migration 0085: a definition's routes that hold ready work, for the probe and for the
    claim of a worker of an earlier release) reads the partial index of routed ready commands, never
    commands_ready: behind 3,000 queued starts and nothing routed it is one probe of an empty index."""
    store = await PostgresStore.open(database_url, "stepstone", max_size=2)
    try:
        await Worker(store, registry).register()
        await Client(store, registry).start_many(three, [{} for _ in range(3_000)])
    finally:
        await store.close()
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(bench_queries("stepstone")["analyze"])
        source = await conn.fetchval("SELECT prosrc FROM pg_proc WHERE proname = 'ready_routes'"
                                     " AND pronamespace = 'stepstone'::regnamespace")
        statement = source.split("RETURN (", 1)[1].rsplit(");", 1)[0].replace("p_definitions", "$1::text[]")
        await conn.execute(f"PREPARE routes AS {statement}")
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        plan = json.loads(await conn.fetchval("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE routes(NULL)"))[0]
        assert await conn.fetchval("EXECUTE routes(NULL)") == []
    finally:
        await conn.close()
    indexes = {n["Index Name"] for n in _nodes(plan["Plan"]) if n.get("Relation Name") == "commands"}
    assert indexes == {"commands_routed"}
    assert plan["Plan"]["Shared Hit Blocks"] + plan["Plan"].get("Shared Read Blocks", 0) <= 2
