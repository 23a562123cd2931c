"""Flow limits: at most N instances of a workflow (or of one key) run at once, the rest wait as rows and
start in start order; a start rate spaces starts out. Checked by the database, not by timing."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from stepstone.errors import InvalidInput
from stepstone.store import postgres
from stepstone.store.postgres import PostgresStore
from stepstone.store.queries import queries
from stepstone.testing import Engine
from tests.perf.generic_plans import function_statement
from tests.scheduling.workflows import busy, long

# A test-only observer: after every change of a slot (every admission and release, serialized by the
# slot row), the number of instances of the bucket that are admitted and not ended, from the rows.
_OBSERVER = """
CREATE TABLE stepstone.observed_running (key_value text, running integer, counted integer);
CREATE FUNCTION stepstone.observe_running() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO stepstone.observed_running
    SELECT NEW.key_value, NEW.running, count(*) FROM stepstone.instances i
    WHERE i.definition_id = NEW.definition_id AND i.flow_key = NEW.key_value AND NOT stepstone.is_ended(i.status)
      AND NOT EXISTS (SELECT 1 FROM stepstone.flow_queue q WHERE q.instance_id = i.id);
    RETURN NULL;
END $$;
CREATE TRIGGER observe_running AFTER INSERT OR UPDATE ON stepstone.flow_slots
    FOR EACH ROW EXECUTE FUNCTION stepstone.observe_running();
-- And, independently of the slots, the instances a worker has run a step of, at every status change.
CREATE TABLE stepstone.observed_active (n integer);
CREATE FUNCTION stepstone.observe_active() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO stepstone.observed_active
    SELECT count(*) FROM stepstone.instances i
    WHERE i.definition_id = NEW.definition_id AND i.status IN ('RUNNING', 'WAITING');
    RETURN NULL;
END $$;
CREATE TRIGGER observe_active AFTER UPDATE OF status ON stepstone.instances
    FOR EACH ROW EXECUTE FUNCTION stepstone.observe_active();
"""


async def _drain(engine: Engine, workers: int = 3) -> None:
    """Run several workers at once until nothing is claimable for any of them."""
    fleet = [engine.worker] + [engine.new_worker(concurrency=8) for _ in range(workers - 1)]
    while True:
        await asyncio.gather(*(w.run_until_idle() for w in fleet))
        if not [c for w in fleet for c in await w.store.claim(1, 30, "probe")]:
            return
        raise AssertionError("work was left claimable after every worker went idle")


async def test_a_limit_of_two_under_200_starts_never_runs_three(engine: Engine, db: asyncpg.Connection) -> None:
    await db.execute(_OBSERVER)
    assert await engine.client.set_flow_limit(busy, max_running=2) == 0
    ids = [await engine.client.start(busy, {"customer": f"c{n % 7}"}) for n in range(200)]
    waiting = await db.fetchval("SELECT count(*) FROM stepstone.flow_queue")
    assert waiting == 198  # the rest wait as rows
    await _drain(engine)
    statuses = await db.fetch("SELECT status, count(*) FROM stepstone.instances GROUP BY status")
    assert {r["status"]: r["count"] for r in statuses} == {"COMPLETED": 200}
    worst = await db.fetchrow("SELECT max(running) AS slot, max(counted) AS counted, count(*) AS n "
                              "FROM stepstone.observed_running")
    assert worst["n"] >= 400  # every admission and release was observed
    assert worst["slot"] == 2 and worst["counted"] == 2
    # (inside a group commit that ends two instances the counter may lag the rows by one until the
    # second one's release runs: it can only be above the rows, never below)
    assert await db.fetchval("SELECT bool_and(counted <= running) FROM stepstone.observed_running")
    assert await db.fetchval("SELECT sum(running) FROM stepstone.flow_slots") == 0
    assert await db.fetchval("SELECT max(n) FROM stepstone.observed_active") <= 2
    # in start order: the k-th started is the k-th admitted, so its first step completes after that of the
    # (k-2)-th, which had to end first: its place among the first steps is k, or k+-1 (two run at once)
    order = await db.fetch(
        "SELECT h.instance_id FROM stepstone.history h WHERE h.kind = 'STEP_COMPLETED' AND h.step = 'first' "
        "ORDER BY h.at, h.instance_id")
    place = {str(r["instance_id"]): n for n, r in enumerate(order)}
    assert len(place) == 200
    assert max(abs(place[iid] - k) for k, iid in enumerate(ids)) <= 1
    [info] = await engine.client.flow_limits()
    assert (info.workflow, info.max_running, info.running, info.waiting) == ("busy", 2, 0, 0)


async def test_a_limit_per_key(engine: Engine, db: asyncpg.Connection) -> None:
    await db.execute(_OBSERVER)
    await engine.client.set_flow_limit(long, max_running=1, key="customer")
    ids = {c: [await engine.client.start(long, {"customer": c}) for _ in range(3)] for c in ("a", "b")}
    await engine.run_until_idle()
    waiting = {c: [(await engine.client.get(i)).status for i in v] for c, v in ids.items()}
    assert waiting == {"a": ["WAITING", "PENDING", "PENDING"], "b": ["WAITING", "PENDING", "PENDING"]}
    await engine.client.signal(ids["a"][0], "done")
    await engine.run_until_idle()
    assert [(await engine.client.get(i)).status for i in ids["a"]] == ["COMPLETED", "WAITING", "PENDING"]
    assert [(await engine.client.get(i)).status for i in ids["b"]] == ["WAITING", "PENDING", "PENDING"]
    assert await db.fetchval("SELECT max(counted) FROM stepstone.observed_running") == 1


async def test_a_key_longer_than_an_index_holds_is_refused_at_the_start(engine: Engine) -> None:
    """The key's bucket is an index entry: a customer of 6,000 random characters was the driver's
    ProgramLimitExceededError from `start` and `start_many`; now InvalidInput, and nothing is stored."""
    await engine.client.set_flow_limit(long, max_running=1, key="customer")
    customer = secrets.token_hex(3000)
    with pytest.raises(InvalidInput, match="larger than PostgreSQL takes there"):
        await engine.client.start(long, {"customer": customer})
    with pytest.raises(InvalidInput, match="larger than PostgreSQL takes there"):
        await engine.client.start_many(long, [{"customer": customer}])
    assert await engine.client.list() == []


async def test_cancelling_a_waiting_instance_frees_nothing_and_its_turn_passes(engine: Engine) -> None:
    await engine.client.set_flow_limit(long, max_running=1)
    first, second, third = [await engine.client.start(long, {}) for _ in range(3)]
    await engine.run_until_idle()
    assert await engine.client.cancel(second) == "CANCELLED"
    await engine.run_until_idle()
    assert (await engine.client.get(third)).status == "PENDING"  # still one running: first
    await engine.client.signal(first, "done")
    await engine.run_until_idle()
    assert (await engine.client.get(third)).status == "WAITING"
    [info] = await engine.client.flow_limits()
    assert (info.running, info.waiting) == (1, 0)


async def test_raising_or_removing_the_limit_admits_the_waiting(engine: Engine) -> None:
    await engine.client.set_flow_limit(long, max_running=1)
    ids = [await engine.client.start(long, {}) for _ in range(4)]
    await engine.run_until_idle()
    assert await engine.client.set_flow_limit(long, max_running=2) == 1
    await engine.run_until_idle()
    assert [(await engine.client.get(i)).status for i in ids] == ["WAITING", "WAITING", "PENDING", "PENDING"]
    assert await engine.client.remove_flow_limit(long) == 2
    await engine.run_until_idle()
    assert {(await engine.client.get(i)).status for i in ids} == {"WAITING"}
    assert await engine.client.flow_limits() == []


async def test_a_start_rate_spaces_starts_on_the_database_clock(engine: Engine) -> None:
    await engine.client.set_flow_limit(busy, min_interval=60)
    ids = [await engine.client.start(busy, {}) for _ in range(3)]
    await engine.run_until_idle()
    assert [(await engine.client.get(i)).status for i in ids] == ["COMPLETED", "PENDING", "PENDING"]
    await engine.move_clock(60)
    await engine.run_until_idle()
    assert [(await engine.client.get(i)).status for i in ids] == ["COMPLETED", "COMPLETED", "PENDING"]
    await engine.move_clock(60)
    await engine.run_until_idle()
    assert (await engine.client.get(ids[2])).status == "COMPLETED"


async def test_bad_limits_are_refused(engine: Engine) -> None:
    with pytest.raises(InvalidInput, match="max_running"):
        await engine.client.set_flow_limit(busy, max_running=0)
    with pytest.raises(InvalidInput, match="takes max_running"):
        await engine.client.set_flow_limit(busy)
    # These once reached the store: an int32 column refused the first; the others were stored, and every
    # later start of the workflow would have put its next admission beyond any timestamp.
    with pytest.raises(InvalidInput, match="max_running must be from 1 to 2147483647"):
        await engine.client.set_flow_limit(busy, max_running=2**40)
    for interval in (float("inf"), 1e300):
        with pytest.raises(InvalidInput, match="at most a thousand years"):
            await engine.client.set_flow_limit(busy, min_interval=interval)
    assert await engine.client.flow_limits() == []


async def test_a_limit_of_two_per_key_under_load(engine: Engine, db: asyncpg.Connection) -> None:
    await db.execute(_OBSERVER)
    await engine.client.set_flow_limit(busy, max_running=2, key="customer")
    for n in range(90):
        await engine.client.start(busy, {"customer": f"c{n % 3}"})
    # Two per key are admitted at once; the other 28 of each key wait as rows.
    held = await db.fetch("SELECT key_value, count(*) AS n FROM stepstone.flow_queue GROUP BY 1 ORDER BY 1")
    assert [(r["key_value"], r["n"]) for r in held] == [("c0", 28), ("c1", 28), ("c2", 28)]
    await _drain(engine)
    assert await db.fetchval("SELECT count(*) FROM stepstone.instances WHERE status = 'COMPLETED'") == 90
    per_key = await db.fetch("SELECT key_value, max(counted) AS most, count(*) AS n FROM stepstone.observed_running "
                             "GROUP BY 1 ORDER BY 1")
    assert [(r["key_value"], r["most"]) for r in per_key] == [("c0", 2), ("c1", 2), ("c2", 2)]
    assert min(r["n"] for r in per_key) >= 60  # every admission and release of each key was observed


async def test_the_claim_stays_one_statement_that_never_reads_the_waiting(
    engine: Engine, db: asyncpg.Connection, database_url: str,
) -> None:
    await engine.client.set_flow_limit(long, max_running=1)
    for _ in range(300):
        await engine.client.start(long, {})
    await engine.run_until_idle()  # one WAITING on its signal; 299 held, their START commands DEFERRED
    assert await db.fetchval("SELECT count(*) FROM stepstone.flow_queue") == 299
    await db.execute("ANALYZE")

    sent: list[str] = []

    async def logging(conn: asyncpg.Connection) -> None:
        await postgres._init_connection(conn)  # the store's codecs
        conn.add_query_logger(lambda record: sent.append(record.query))

    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=1, init=logging)
    store = PostgresStore(pool, database_url, "stepstone")
    try:
        assert await store.claim(16, 30, "probe", [long.plan.definition_id]) == []  # as a worker asks
    finally:
        await store.close()
    claim = queries("stepstone")["claim"]
    assert [q for q in sent if '"stepstone".' in q] == [claim]  # (the pool's own reset names no table)

    # Its search for work reads none of the held commands: they are passed over by the index, not
    # read and filtered row by row. (The plan of the UPDATE that takes the found rows depends on the
    # table's size, here small; tests/perf/test_query_plans.py guards it with 20,000 rows.)
    search = await function_statement(db, "claim_heads")  # the claim's statement (migration 0036)
    explained = db.transaction()
    await explained.start()
    try:
        [[plan]] = await db.fetch(f"EXPLAIN (ANALYZE, FORMAT JSON) {search}", 16, 30.0, "probe",
                                  [long.plan.definition_id])
    finally:
        await explained.rollback()  # EXPLAIN ANALYZE runs the claim: leave nothing behind
    plan = json.loads(plan) if isinstance(plan, str) else plan

    def nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield node
        for child in node.get("Plans", []):
            yield from nodes(child)

    searches = [n for n in nodes(plan[0]["Plan"]) if n.get("Subplan Name") in ("CTE expired", "CTE ready")]
    assert len(searches) == 2, [n.get("Subplan Name") for n in nodes(plan[0]["Plan"])]
    on_commands = [n for search in searches for n in nodes(search) if n.get("Relation Name") == "commands"]
    assert on_commands and all(n["Node Type"] != "Seq Scan" for n in on_commands), on_commands
    read = sum(n["Actual Rows"] * n.get("Actual Loops", 1) + n.get("Rows Removed by Filter", 0)
               for n in on_commands)
    assert read < 30, f"the claim's search read {read} command rows with 299 held"


async def test_a_new_limit_counts_only_instances_started_under_it(engine: Engine, db: asyncpg.Connection) -> None:
    before = [await engine.client.start(long, {}) for _ in range(2)]
    await engine.run_until_idle()
    await engine.client.set_flow_limit(long, max_running=1)
    after = [await engine.client.start(long, {}) for _ in range(2)]
    await engine.run_until_idle()
    # The two already running hold no slot: the first started under the limit is admitted beside them.
    assert [(await engine.client.get(i)).status for i in before + after] == ["WAITING"] * 3 + ["PENDING"]
    assert await db.fetchval("SELECT count(*) FROM stepstone.instances WHERE flow_key IS NULL") == 2
