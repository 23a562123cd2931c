"""A claim's commit does not wait for the disk: one lost with the server is as if it never happened.

The claim statement turns synchronous_commit off for its own transaction (queries.sql, `claim`). That is
safe only because a lost claim leaves its command as it was, claimable again, and because the worker
that held it is fenced at its commit, its token being nowhere. Here the server stops at once (`pg_ctl
-m immediate`) right after a claim, with the WAL writer slowed so that nothing writes the claim's WAL
out before: the claim must be gone, the command claimable, the holder's commit refused, and the
taker's step committed once.
"""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.core.model import RunStep, StepSucceeded
from stepstone.core.transitions import apply, complete_step
from stepstone.runtime.worker import pin_of
from stepstone.store.migrate import migrate
from stepstone.store.port import Claim, CommitRequest
from stepstone.testing import open_engine
from tests.chaos.rig.server import RigServer

wf: Workflow[Any] = Workflow("unflushed-claim", version=1)


@wf.step(start=True, next=None)
def bump(ctx: StepContext, state: dict[str, Any]) -> None:
    state["n"] = state.get("n", 0) + 1


registry = Registry(wf)

HELD = """SELECT c.state, c.token, p.lease_token FROM stepstone.commands c
JOIN stepstone.positions p ON p.instance_id = c.instance_id AND p.path = c.position
WHERE c.instance_id = $1"""


async def _commit(engine: Any, claim: Claim) -> Any:
    run = apply(claim.instance, claim.command, wf.plan, claim.now)
    assert isinstance(run, RunStep)
    decision = complete_step(claim.instance, claim.command, wf.plan, StepSucceeded(None, {"n": 1}), claim.now)
    request = CommitRequest(claim, claim.command.id, decision, run.visit, claim.instance.state_version)
    return await engine.store.commit(request, lease_seconds=30.0, worker="test")


async def _set_wal_writer_delay(url: str, value: str | None) -> None:
    conn = await asyncpg.connect(url)
    try:
        if value is None:
            await conn.execute("ALTER SYSTEM RESET wal_writer_delay")
        else:
            await conn.execute(f"ALTER SYSTEM SET wal_writer_delay = '{value}'")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()


async def test_a_claim_lost_with_the_server_leaves_its_command_claimable_and_its_holder_fenced(
    rig_pg: RigServer,
) -> None:
    name = f"unflushed_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(rig_pg.url())
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    url = rig_pg.url(name)
    conn = await asyncpg.connect(url)
    try:
        await migrate(conn, "stepstone")
    finally:
        await conn.close()
    await _set_wal_writer_delay(rig_pg.url(), "10s")  # the claim's WAL stays in memory until the stop
    try:
        async with open_engine(url, registry) as engine:
            await engine.store.register(pin_of(wf), wf.plan.document())
            iid = await engine.client.start(wf, {"n": 0})  # a flushed commit: the start survives
            [held] = await engine.store.claim(1, 30.0, "holder")
            conn = await asyncpg.connect(url)
            try:
                assert [tuple(r) for r in await conn.fetch(HELD, iid)] == [("CLAIMED", held.token, held.token)]
            finally:
                await conn.close()
            rig_pg.restart("immediate")
    finally:
        await _set_wal_writer_delay(rig_pg.url(), None)
    async with open_engine(url, registry) as engine:
        conn = await asyncpg.connect(url)
        try:
            after = [tuple(r) for r in await conn.fetch(HELD, iid)]
            assert after == [("PENDING", None, None)], f"the claim outlived the server's stop: {after}"
            [taker] = await engine.store.claim(1, 30.0, "taker")
            assert taker.command.id == held.command.id and taker.token != held.token
            assert await _commit(engine, held) is None, "the holder of the lost claim was not fenced"
            assert await _commit(engine, taker) is not None
            steps = await conn.fetchval(
                "SELECT count(*) FROM stepstone.history WHERE instance_id = $1 AND kind = 'STEP_COMPLETED'", iid)
        finally:
            await conn.close()
        assert steps == 1
        assert (await engine.client.get(iid)).status == "COMPLETED"
