"""The checker can fail: a clean run of every rig workflow (chains, fan-outs, a parent with its child) is
checked clean, then each fabricated violation of a branch or child rule, applied in a transaction that is
rolled back, must be reported under its own name.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from stepstone.testing import open_engine
from tests._pg import PgServer
from tests.chaos import workflows
from tests.chaos.rig import checker
from tests.chaos.rig.scenarios import Target, scenario_database, start_instances

N = 8  # top-level workflows: at least two fan-outs and two parents among them

# Append a copy of the first history row of `kind` (in a branch when $2, at the root otherwise) to its
# instance, keeping history gapless, so only the rule under test is broken.
COPY_HISTORY = """
WITH src AS (SELECT * FROM stepstone.history WHERE kind = $1 AND (position <> '') = $2
             ORDER BY instance_id, seq LIMIT 1),
     bump AS (UPDATE stepstone.instances i SET history_seq = i.history_seq + 1 FROM src
              WHERE i.id = src.instance_id RETURNING i.id, i.history_seq)
INSERT INTO stepstone.history (instance_id, seq, at, kind, step, visit, command_id, actor, data, position)
SELECT src.instance_id, bump.history_seq, src.at, src.kind, src.step, src.visit, src.command_id, src.actor,
       src.data, src.position
FROM src JOIN bump ON bump.id = src.instance_id
"""

SECOND_CHILD = """
INSERT INTO stepstone.instances (id, scope, definition_id, version, plan_hash, status, state, step, visit,
                                 parent_id, parent_position, parent_visit, next_seq, history_seq,
                                 created_at, updated_at)
SELECT $1, scope, definition_id, version, plan_hash, status, state, step, visit, parent_id, parent_position,
       parent_visit, next_seq, 0, created_at, updated_at
FROM stepstone.instances WHERE parent_id IS NOT NULL ORDER BY id LIMIT 1
"""

LOSE_UPDATE = """
UPDATE stepstone.instances SET state = jsonb_set(state, '{done,0}', '1')
WHERE id = (SELECT min(id::text)::uuid FROM stepstone.instances WHERE definition_id LIKE 'chaosfan-%')
"""

REOPEN = """
UPDATE stepstone.positions SET status = 'RUNNING'
WHERE (instance_id, path) = (SELECT instance_id, path FROM stepstone.positions WHERE path <> '' ORDER BY 1, 2 LIMIT 1)
"""

MUTATIONS: dict[str, list[tuple[str, tuple[Any, ...]]]] = {
    # a branch step committed twice
    "step_twice": [(COPY_HISTORY, ("STEP_COMPLETED", True))],
    # the join fired twice for one fork visit
    "join_twice": [(COPY_HISTORY, ("JOINED", False))],
    # a branch reported to the join twice
    "branch_joined": [(COPY_HISTORY, ("BRANCH_JOINED", False))],
    # one branch's write to the shared state lost
    "lost_update": [(LOSE_UPDATE, ())],
    # a second child for one child-step visit (a started-twice child)
    "child_twice": [(SECOND_CHILD, (uuid.uuid4(),))],
    # the child step's start recorded twice
    "child_started_twice": [(COPY_HISTORY, ("CHILD_STARTED", False))],
    # the parent resumed twice
    "parent_resumed": [(COPY_HISTORY, ("CHILD_COMPLETED", False))],
    # a branch left open under a completed instance
    "open_position": [(REOPEN, ())],
}
EXPECTED = {"child_started_twice": "child_twice"}


@pytest.fixture
async def clean_run(pg_server: PgServer) -> AsyncIterator[str]:
    async with scenario_database(Target(pg_server.admin_url), "checker") as url:
        await start_instances(url, N, random.Random(3), fans=0.25, parents=0.25)  # noqa: S311 - a test mix
        workflows.configure(url, "checker-test")
        try:
            async with open_engine(url, workflows.registry, concurrency=8) as engine:
                await engine.advance(seconds=1)  # runs everything, the chains' naps too
        finally:
            if workflows.LEDGER.pool is not None:
                await workflows.LEDGER.pool.close()
            workflows.LEDGER.pool, workflows.LEDGER.lock = None, None
        yield url


async def _kinds(conn: asyncpg.Connection, **kwargs: Any) -> set[str]:
    report = await checker.check(conn, expected=N, **kwargs)
    return {v.split(":", 1)[0] for v in report["violations"]}


async def test_checker_reports_each_fabricated_branch_and_child_violation(clean_run: str) -> None:
    conn = await asyncpg.connect(clean_run)
    try:
        report = await checker.check(conn, expected=N)
        assert report["violations"] == [], report
        assert report["fan_outs"] >= 2 and report["children"] >= 2 and report["joins"] == report["fan_outs"]
        for name, statements in MUTATIONS.items():
            tr = conn.transaction()
            await tr.start()
            try:
                for sql, args in statements:
                    status = await conn.execute(sql, *args)
                    assert status.split()[-1] != "0", f"{name}: the mutation changed nothing ({sql})"
                kinds = await _kinds(conn)
            finally:
                await tr.rollback()
            assert EXPECTED.get(name, name) in kinds, f"{name}: the checker reported only {kinds}"
        assert await _kinds(conn) == set(), "the rollbacks left the run clean"
    finally:
        await conn.close()


async def test_checker_reports_repeated_branch_effects_beyond_their_fences(clean_run: str) -> None:
    """A branch step's effect repeated by one process more often than its commits were fenced, or by no
    kill, pause or fence at all, is reported (the accounting of the chain steps, applied to branches)."""
    conn = await asyncpg.connect(clean_run)
    try:
        key = await conn.fetchval("SELECT key FROM chaos.ledger WHERE key LIKE '%/fan/%' ORDER BY key LIMIT 1")
        instance, position, step, visit = checker.split_key(key)
        assert position.startswith("fan/") and step in ("s1", "s2")
        tr = conn.transaction()
        await tr.start()
        try:
            for _ in range(2):  # two more runs by pid 4242, which had one commit of it fenced
                await conn.execute(
                    "INSERT INTO chaos.ledger (effect_id, key, instance_id, step, attempt, pid, worker) "
                    "VALUES ($1, $2, $3, $4, 1, 4242, 'zombie')", uuid.uuid4(), key, uuid.UUID(instance), step)
            fence = [{"pid": 4242, "instance": instance, "position": position, "visit": visit}]
            assert "fenced_repeats" in await _kinds(conn, fenced=fence)
            assert "unexplained_dup" in await _kinds(conn), "with no fence at all the repeats are unexplained"
            elsewhere = [{**fence[0], "position": "fan/999"}]  # a fence of another branch explains nothing
            assert "unexplained_dup" in await _kinds(conn, fenced=elsewhere)
        finally:
            await tr.rollback()
    finally:
        await conn.close()
