"""An operator replays a parent from its child step and retries the parent's failed child: one or the other.

The parent (ops_caller) failed because its child (ops_fragile) failed for good. Once the upstream is back
the operator may retry the child (then the parent, which goes on with the child's result) or replay the
parent from its child step (which starts a new child). Doing both ran the child's steps in both children.
Now whichever comes second is refused and changes nothing: a retry of the child once the replay moved the
parent past it (ChildNotAwaited), and a replay of the parent while the retried child is under way. Run
concurrently, the two are decided by the child's row lock, which the replay takes before it writes; each
race holds one side's transaction open in another connection (docs/operations.md, "Children and replay").
A child that ended before the replay is its own business: the replay starts a new child, as documented.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator

import asyncpg
import httpx
import pytest
from asyncpg.transaction import Transaction
from click.testing import CliRunner

from stepstone.api import context_on, create_app
from stepstone.api.tokens import create_token
from stepstone.cli import cli
from stepstone.errors import ChildNotAwaited, InvalidState
from stepstone.ops import Operations
from stepstone.testing import Engine
from tests._pg import until_shown
from tests.ops import workflows

OPEN = ("PENDING", "DEFERRED", "CLAIMED", "PARKED")


@pytest.fixture(autouse=True)
def _calls() -> Iterator[None]:
    workflows.CALLS.clear()
    workflows.HOLD.clear()
    yield
    workflows.HOLD.clear()


async def _failed_tree(engine: Engine) -> tuple[str, str]:
    """A parent FAILED (ChildFailed) on its FAILED child; the upstream is back afterwards."""
    workflows.FAILURES[workflows.fragile.id] = -1
    parent = await engine.client.start(workflows.caller, {})
    await engine.run_until_idle()
    workflows.FAILURES.pop(workflows.fragile.id)
    [child] = [str(c["id"]) for c in (await engine.client.get(parent)).children]
    assert ((await engine.client.get(parent)).status, (await engine.client.get(child)).status) == ("FAILED", "FAILED")
    return parent, child


async def _footprint(conn: asyncpg.Connection, child: str) -> tuple[object, ...]:
    """What a retry of the child would change: its status, its commands and its history."""
    return (await conn.fetchval("SELECT status FROM stepstone.instances WHERE id = $1", uuid.UUID(child)),
            [tuple(r) for r in await conn.fetch("SELECT id, kind, state FROM stepstone.commands WHERE instance_id = $1 "
                                                "ORDER BY id", uuid.UUID(child))],
            await conn.fetchval("SELECT count(*) FROM stepstone.history WHERE instance_id = $1", uuid.UUID(child)))


def _refusal(child: str, parent: str, tail: str) -> str:
    return (f"instance {child} is not retried: its parent {parent} has moved past the step visit that started it "
            f"(visit 1; it is {tail}), so nothing takes this child's result and its steps would run again beside "
            "what the parent went on with. Nothing changed. Leave it FAILED, or run it anyway as an instance of its "
            f"own: stepstone replay --instance {child} --from call")


async def _parent_completes_on_one_child(engine: Engine, conn: asyncpg.Connection, parent: str, child: str, *,
                                         ignored: int) -> None:
    """`ignored`: the child's reports the parent recorded and did not take (a retried child's end reaches
    its FAILED parent before the parent is retried: docs/branches.md)."""
    info = await engine.client.get(parent)
    assert (info.status, info.state) == ("COMPLETED", {"result": f"paid by {child}", "child_id": child})
    assert [child] == workflows.CALLS  # the child's step ran once, in one child
    kinds = [e["kind"] for e in await engine.client.history(parent)]
    assert (kinds.count("CHILD_COMPLETED"), kinds.count("INSTANCE_COMPLETED"), kinds.count("CALLBACK_IGNORED")) == (
        1, 1, ignored)
    ids = [parent, *(str(c["id"]) for c in info.children)]
    assert await conn.fetchval("SELECT count(*) FROM stepstone.commands WHERE instance_id = ANY($1::uuid[]) "
                               "AND state = ANY($2::text[])", ids, list(OPEN)) == 0


async def test_a_retry_of_a_child_whose_parent_was_replayed_is_refused_and_changes_nothing(
    engine: Engine, ops: Operations, conn: asyncpg.Connection, database_url: str
) -> None:
    parent, old = await _failed_tree(engine)
    assert (await ops.replay(parent, "call_fragile")).visit == 2
    before = await _footprint(conn, old)

    with pytest.raises(ChildNotAwaited) as refused:
        await engine.client.retry(old)
    assert str(refused.value) == _refusal(old, parent, "RUNNING at step 'call_fragile', visit 2")
    assert (refused.value.parent_id, refused.value.parent_status, refused.value.awaits) == (parent, "RUNNING", None)
    said = await asyncio.to_thread(
        CliRunner().invoke, cli, ["retry", "--database-url", database_url, old], catch_exceptions=False)
    assert (said.exit_code, said.stdout, said.stderr.strip()) == (1, "", f"error: {refused.value}")
    bulk = await ops.retry([old])
    [item] = bulk.items
    assert (bulk.succeeded, bulk.failed, item.outcome, item.reason) == (0, 1, "not_awaited", str(refused.value))
    assert await _footprint(conn, old) == before

    # The replayed step started its new child, whose step is under way: the refusal names it.
    workflows.HOLD.update(entered=asyncio.Event(), release=asyncio.Event())
    running = asyncio.create_task(engine.run_until_idle())
    await asyncio.wait_for(workflows.HOLD["entered"].wait(), 30)
    [new] = [str(c["id"]) for c in (await engine.client.get(parent)).children if str(c["id"]) != old]
    with pytest.raises(ChildNotAwaited) as waiting:
        await engine.client.retry(old)
    assert str(waiting.value) == _refusal(old, parent, f"WAITING at step 'call_fragile', visit 2, awaiting child "
                                                       f"{new} instead")
    assert (waiting.value.parent_status, waiting.value.awaits) == ("WAITING", new)
    workflows.HOLD["release"].set()
    await running
    await engine.run_until_idle()
    await _parent_completes_on_one_child(engine, conn, parent, new, ignored=0)
    assert (await engine.client.get(old)).status == "FAILED"  # left as it failed

    # The parent has ended since: still refused, and the message names the child it went on with.
    with pytest.raises(ChildNotAwaited) as again:
        await engine.client.retry(old)
    assert str(again.value).startswith(f"instance {old} is not retried: its parent {parent} has ended (COMPLETED), so ")
    repair = await asyncio.to_thread(
        CliRunner().invoke, cli, ["--database-url", database_url, "repair", "retry", old, "-o", "json"])
    assert repair.exit_code == 4, repair.output
    [row] = json.loads(repair.stdout)["items"]
    assert (row["ok"], row["outcome"], row["reason"]) == (False, "not_awaited", str(again.value))
    assert await _footprint(conn, old) == before


async def test_the_http_api_refuses_the_retry_with_its_own_error(
    engine: Engine, ops: Operations, database_url: str
) -> None:
    parent, old = await _failed_tree(engine)
    await ops.replay(parent, "call_fragile")
    ctx = context_on(engine.store, registry=workflows.registry)
    try:
        token, _ = await create_token(ctx.management, role="operator", scope="*")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)), base_url="http://t") as http:
            answer = await http.post(f"/api/v1/instances/{old}/retry", headers={"Authorization": f"Bearer {token}"})
    finally:
        await ctx.close()
    body = answer.json()
    assert (answer.status_code, body["error"], body["instance_id"], body["instance_status"]) == (
        409, "ChildNotAwaited", old, "FAILED")
    assert (body["parent_id"], body["parent_status"], body["awaits"]) == (parent, "RUNNING", None)
    assert body["detail"] == _refusal(old, parent, "RUNNING at step 'call_fragile', visit 2")


@pytest.mark.parametrize("when", ["retried", "during the retried step"])
async def test_a_replay_of_a_parent_whose_child_was_retried_is_refused_while_the_child_runs(
    engine: Engine, ops: Operations, conn: asyncpg.Connection, when: str
) -> None:
    """The retried child is under way: the replay is refused and changes nothing; the child ends, and the
    parent, retried, goes on with its result (the runbook's way)."""
    parent, old = await _failed_tree(engine)
    assert (await ops.retry([old])).succeeded == 1
    running = None
    if when == "during the retried step":
        workflows.HOLD.update(entered=asyncio.Event(), release=asyncio.Event())
        running = asyncio.create_task(engine.run_until_idle())
        await asyncio.wait_for(workflows.HOLD["entered"].wait(), 30)
    seq = await conn.fetchval("SELECT history_seq FROM stepstone.instances WHERE id = $1", uuid.UUID(parent))
    with pytest.raises(InvalidState) as refused:
        await ops.replay(parent, "call_fragile")
    assert str(refused.value) == (
        f"instance {parent} is not replayed: it still awaits its child {old} (ops_fragile, RUNNING), which has not "
        "ended; a replay would leave that child running for a result nothing takes, and its steps would run again "
        f"in the child the replayed step starts. Nothing changed. Wait for the child to end, then retry {parent} "
        f"(it goes on with the child's result), or cancel the child first (stepstone cancel {old}) and replay again")
    assert (await engine.client.get(parent)).status == "FAILED"
    assert await conn.fetchval("SELECT history_seq FROM stepstone.instances WHERE id = $1", uuid.UUID(parent)) == seq
    if running is not None:
        workflows.HOLD["release"].set()
        await running
    await engine.run_until_idle()
    assert (await engine.client.get(old)).status == "COMPLETED"
    assert (await ops.retry([parent])).succeeded == 1
    await engine.run_until_idle()
    await _parent_completes_on_one_child(engine, conn, parent, old, ignored=1)


async def test_a_replay_after_the_retried_child_ended_starts_a_new_child(
    engine: Engine, ops: Operations
) -> None:
    """Retried and ended, the child is no longer under way: the replay goes on and its step starts a new
    child, as any replay from a child step does; the old child's result is not taken."""
    parent, old = await _failed_tree(engine)
    await ops.retry([old])
    await engine.run_until_idle()
    assert (await ops.replay(parent, "call_fragile")).visit == 2
    await engine.run_until_idle()
    info = await engine.client.get(parent)
    [new] = [str(c["id"]) for c in info.children if str(c["id"]) != old]
    assert (info.status, info.state["child_id"], workflows.CALLS) == ("COMPLETED", new, [old, new])


@contextlib.asynccontextmanager
async def _holding(database_url: str) -> AsyncIterator[tuple[asyncpg.Connection, Transaction]]:
    """Another connection with a transaction open, whose locks the other side waits for until it commits."""
    holder = await asyncpg.connect(database_url)
    try:
        held = holder.transaction()
        await held.start()
        yield holder, held
    finally:
        await holder.close()


async def _waits_for(conn: asyncpg.Connection, holder: asyncpg.Connection, failure: str) -> None:
    await until_shown(conn, "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                      holder.get_server_pid(), timeout=30, failure=failure)


async def test_a_retry_waiting_for_a_replays_lock_is_refused(
    engine: Engine, ops: Operations, conn: asyncpg.Connection, database_url: str
) -> None:
    """The replay holds the child's row (taken before it writes) until it commits; the retry that waits for it
    then reads the parent moved on."""
    parent, old = await _failed_tree(engine)
    seq = await conn.fetchval("SELECT history_seq FROM stepstone.instances WHERE id = $1", uuid.UUID(parent))
    async with _holding(database_url) as (holder, held):
        [replayed] = await holder.fetch("SELECT * FROM stepstone.replay_instance($1, 'call_fragile', '{}', '{}', $2, "
                                        "1, 'oncall')", uuid.UUID(parent), seq)
        assert replayed["outcome"] == "replayed"
        retrying = asyncio.ensure_future(ops.retry([old]))
        await _waits_for(conn, holder, "the retry never waited for the replay")
        assert not retrying.done()
        await held.commit()
        report = await retrying
    [item] = report.items
    assert (report.succeeded, item.outcome, item.status) == (0, "not_awaited", "FAILED")
    assert (await engine.client.get(old)).status == "FAILED"


async def test_a_replay_waiting_for_a_retrys_lock_is_refused(
    engine: Engine, ops: Operations, conn: asyncpg.Connection, database_url: str
) -> None:
    """The retry holds the child's row until it commits; the replay that waits for it then sees the child
    running and is refused, with nothing of the parent changed."""
    parent, old = await _failed_tree(engine)
    seq = await conn.fetchval("SELECT history_seq FROM stepstone.instances WHERE id = $1", uuid.UUID(parent))
    async with _holding(database_url) as (holder, held):
        assert await holder.fetchval("SELECT (stepstone.retry_saga($1, 'oncall')).outcome", uuid.UUID(old)) == "retried"
        replaying = asyncio.ensure_future(ops.replay(parent, "call_fragile"))
        await _waits_for(conn, holder, "the replay never waited for the retry")
        assert not replaying.done()
        await held.commit()
        with pytest.raises(InvalidState, match=f"it still awaits its child {old} \\(ops_fragile, RUNNING\\)"):
            await replaying
    assert await conn.fetchval("SELECT history_seq FROM stepstone.instances WHERE id = $1", uuid.UUID(parent)) == seq
    await engine.run_until_idle()
    assert (await ops.retry([parent])).succeeded == 1
    await engine.run_until_idle()
    await _parent_completes_on_one_child(engine, conn, parent, old, ignored=1)
