"""A feature's effect runs inside the fenced commit through `effect_sections`, without editing
commit_decision: its writer fills `ext`, its function writes its rows, a fenced commit writes none,
and a function that raises leaves nothing of the commit behind."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import asyncpg
import pytest

from stepstone.core.effects import Effect, EndInstance, MovePosition, RecordHistory
from stepstone.core.model import Decision, Settle
from stepstone.store import effects as store_effects
from stepstone.store.port import CommitRequest
from stepstone.testing import Engine
from tests.engine.conftest import Rows
from tests.engine.workflows import three

_SETUP = """
CREATE TABLE stepstone.probe_rows (instance_id uuid, position text, command bigint, label text, at timestamptz);
CREATE FUNCTION stepstone.probe_section(p_commit jsonb, p_items jsonb, p_now timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM jsonb_array_elements(p_items) AS x WHERE x->>'label' = 'boom') THEN
        RAISE EXCEPTION 'probe refused' USING ERRCODE = 'P0001';
    END IF;
    INSERT INTO stepstone.probe_rows
    SELECT (p_commit->>'instance')::uuid, p_commit->>'position', (p_commit->>'command')::bigint, x->>'label', p_now
    FROM jsonb_array_elements(p_items) AS x;
END $$;
INSERT INTO stepstone.effect_sections VALUES ('probe', 100, 'probe_section');
"""


@dataclass(frozen=True)
class Probe(Effect):
    label: str


@pytest.fixture
def probe_writer() -> Iterator[None]:
    store_effects.WRITERS[Probe] = lambda e, doc: doc.extend("probe", {"label": e.label})
    try:
        yield
    finally:
        del store_effects.WRITERS[Probe]


def _finish(label: str) -> Decision:
    return Decision(Settle("COMPLETE"), (
        MovePosition("COMPLETED", None, 2), RecordHistory("INSTANCE_COMPLETED", None, 2),
        EndInstance("COMPLETED"), Probe(label),
    ))


async def test_feature_section_runs_in_the_fenced_commit(
    engine: Engine, rows: Rows, database_url: str, probe_writer: None
) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(_SETUP)
        iid = await engine.client.start(three, {"order_id": "x-1"})
        [claim] = await engine.store.claim(1, 30, "w")

        stale = dataclasses.replace(claim, token=uuid.uuid4())
        assert await engine.store.commit(CommitRequest(stale, claim.command.id, _finish("a"), 1),
                                         lease_seconds=30, worker="w") is None
        assert await conn.fetchval("SELECT count(*) FROM stepstone.probe_rows") == 0

        before = await rows.dump()
        with pytest.raises(asyncpg.RaiseError):
            await engine.store.commit(CommitRequest(claim, claim.command.id, _finish("boom"), 1),
                                      lease_seconds=30, worker="w")
        assert await rows.dump() == before

        assert await engine.store.commit(CommitRequest(claim, claim.command.id, _finish("a"), 1),
                                         lease_seconds=30, worker="w") is not None
        [row] = await conn.fetch("SELECT * FROM stepstone.probe_rows")
        assert (str(row["instance_id"]), row["position"], row["command"], row["label"]) == (
            iid, "", claim.command.id, "a")
        assert (await engine.client.get(iid)).status == "COMPLETED"
    finally:
        await conn.close()
