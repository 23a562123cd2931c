"""Every command carries its instance's definition id (migrations 0038-0040), so that a worker serving some
workflows walks only their ready commands: the starts and the step commit name it, a trigger fills it
for every other insert, and the migration gave it to the commands already queued. A claim that names no
definitions walks those that have ready commands (`ready_definitions`, migration 0042)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from stepstone.authoring.workflow import Registry
from stepstone.runtime.worker import Worker
from stepstone.store import migrate as m
from stepstone.testing import Engine, open_engine
from tests.engine import branch_workflows as bw


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, bw.registry, concurrency=4, lease_seconds=30) as e:
        yield e


_MISMATCHED = """
SELECT c.kind, c.definition, i.definition_id FROM stepstone.commands c
JOIN stepstone.instances i ON i.id = c.instance_id
WHERE c.definition IS DISTINCT FROM i.definition_id
"""


async def test_every_command_names_its_instance_definition(engine: Engine) -> None:
    client = engine.client
    ids = [
        await client.start(bw.static, {}),  # a fork: branch commands
        await client.start(bw.mapped, {"items": [1, 2, 3]}),
        await client.start(bw.parent, {}),  # a child (started by the commit) that reports to its parent
        await client.start(bw.gated, {}),  # signals, one per gate
        *await client.start_many(bw.job, [{}, {}]),
    ]
    await engine.run_until_idle()
    for gate in ("g1", "g2"):
        await client.signal(ids[3], "open", gate, position=f"gates/{gate}")
    await engine.run_until_idle()
    assert [(await client.get(i)).status for i in ids] == ["COMPLETED"] * len(ids)
    pool = engine.store.pool  # type: ignore[attr-defined]
    kinds = {r["kind"] for r in await pool.fetch("SELECT DISTINCT kind FROM stepstone.commands")}
    assert {"START", "STEP", "SIGNAL", "BRANCH_DONE", "CHILD_COMPLETION"} <= kinds, kinds
    assert [tuple(r) for r in await pool.fetch(_MISMATCHED)] == []


async def test_a_command_of_an_instance_that_does_not_exist_is_refused(engine: Engine) -> None:
    pool = engine.store.pool  # type: ignore[attr-defined]
    with pytest.raises(asyncpg.ForeignKeyViolationError, match="does not exist"):
        await pool.execute(
            "INSERT INTO stepstone.commands (instance_id, seq, kind, state, available_at, created_at)"
            " VALUES ($1, 1, 'SIGNAL', 'PENDING', now(), now())", uuid.uuid4())


async def test_commands_queued_before_the_migration_get_their_definition(
    empty_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = [x for x in m.shipped_migrations() if x.version < 38]
    monkeypatch.setattr(m, "shipped_migrations", lambda: before)
    conn = await asyncpg.connect(empty_database_url)
    try:
        await m.migrate(conn, "stepstone")
    finally:
        await conn.close()
    async with open_engine(empty_database_url, bw.registry) as engine:  # migrated to version 37
        queued = [await engine.client.start(bw.job, {}) for _ in range(3)]
    monkeypatch.undo()
    conn = await asyncpg.connect(empty_database_url)
    try:
        assert [x.version for x in await m.migrate(conn, "stepstone")] == [x.version for x in m.shipped_migrations()
                                                                           if x.version >= 38]
        assert [tuple(r) for r in await conn.fetch(_MISMATCHED)] == []
    finally:
        await conn.close()
    async with open_engine(empty_database_url, bw.registry) as engine:
        only_jobs = Worker(engine.store, Registry(bw.job))  # claims through the new index alone
        await only_jobs.run_until_idle()
        assert [(await engine.client.get(i)).status for i in queued] == ["COMPLETED"] * 3


_QUEUED_DEFINITIONS = """
SELECT COALESCE(array_agg(DISTINCT c.definition ORDER BY c.definition), '{}') FROM stepstone.commands c
WHERE c.state IN ('PENDING', 'DEFERRED')
"""


async def test_ready_definitions_are_the_definitions_with_queued_commands(engine: Engine) -> None:
    """`ready_definitions` (migration 0042) finds them one probe of commands_ready each: what a claim or a
    look-up that names no definitions walks. A definition whose commands all settled is not among them."""
    client = engine.client
    pool = engine.store.pool  # type: ignore[attr-defined]
    assert await pool.fetchval("SELECT stepstone.ready_definitions()") == []
    done = await client.start(bw.static, {})
    await engine.run_until_idle()
    assert (await client.get(done)).status == "COMPLETED"
    await client.start_many(bw.job, [{}, {}])
    await client.start(bw.gated, {})
    await client.start(bw.mapped, {"items": [1]})
    expected = sorted({bw.job.plan.definition_id, bw.gated.plan.definition_id, bw.mapped.plan.definition_id})
    assert await pool.fetchval("SELECT stepstone.ready_definitions()") == expected
    assert await pool.fetchval(_QUEUED_DEFINITIONS) == expected


async def test_a_claim_naming_no_definitions_fills_its_batch_from_every_definition(engine: Engine) -> None:
    """The claim of a caller that serves every workflow walks each definition that has ready work, from the
    one whose oldest command is oldest, until its batch is full."""
    client = engine.client
    jobs = await client.start_many(bw.job, [{}, {}, {}])
    gates = [await client.start(bw.gated, {}) for _ in range(2)]
    claims = await engine.store.claim(8, 30.0, "everything")
    assert sorted(c.instance.id for c in claims) == sorted([*jobs, *gates])
    assert await engine.store.claim(8, 30.0, "everything") == []  # each queue's head is claimed
