"""Retention: seeded windows, archive then purge in bounded batches, never an active instance, never one
holding an unsent or dead-lettered event, one sweep at a time, and no deadlock beside a running worker."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import asyncpg
import pytest

from stepstone.errors import InvalidInput
from stepstone.ops import InstanceFilter, Operations
from stepstone.ops.retention import RetentionLoop
from stepstone.testing import Engine
from tests.ops import workflows

DAY = 86_400.0


async def _completed(engine: Engine, n: int) -> list[str]:
    ids = [await engine.client.start(workflows.flaky, {"name": f"j{k}"}) for k in range(n)]
    await engine.run_until_idle()
    return ids


async def test_the_documented_windows_are_seeded(ops: Operations) -> None:
    rows = {(r["workflow"], r["status_class"]): r["retain_for"] for r in await ops.retention_policies()}
    assert rows == {
        ("*", "completed"): timedelta(days=30),
        ("*", "failed"): timedelta(days=180),
        ("*", "waiting"): None,
        ("*", "outbox_published"): timedelta(days=7),
    }


async def test_archive_then_purge_in_batches(engine: Engine, ops: Operations, conn: asyncpg.Connection) -> None:
    old = await _completed(engine, 7)
    await engine.move_clock(31 * DAY)
    young = await _completed(engine, 2)
    dry = await ops.retention_run(dry_run=True, batch_size=3)
    assert (dry.archived, dry.purged) == (7, 0)
    assert await conn.fetchval("SELECT count(*) FROM stepstone.instances WHERE archived_at IS NOT NULL") == 0
    report = await ops.retention_run(batch_size=3)
    assert (report.archived, report.purged, report.skipped_active) == (7, 0, 0)
    assert report.batches >= 3  # 7 candidates, 3 a batch
    # Archived instances leave the default lists, and show when asked for.
    assert {i.id for i in (await ops.find()).items} == set(young)
    assert len((await ops.find(InstanceFilter(include_archived=True))).items) == 9
    await engine.move_clock(DAY + 60)
    report = await ops.retention_run(batch_size=3)
    assert report.purged == 7
    for table in ("instances", "positions", "commands", "history"):
        column = "id" if table == "instances" else "instance_id"
        left = await conn.fetchval(f"SELECT count(*) FROM stepstone.{table} WHERE {column} = ANY($1::uuid[])", old)
        assert left == 0, table
    assert await conn.fetchval("SELECT count(*) FROM stepstone.instances") == 2


async def test_a_sweep_narrowed_to_a_workflow_and_a_scope(engine: Engine, ops: Operations,
                                                          conn: asyncpg.Connection, database_url: str) -> None:
    await ops.set_retention_policy("*", "completed", timedelta(days=1), timedelta(0))
    acme = [await engine.client.start(workflows.flaky, {}, scope="acme") for _ in range(2)]
    other = [await engine.client.start(workflows.flaky, {}) for _ in range(3)]
    await engine.run_until_idle()
    await engine.move_clock(2 * DAY)
    assert (await ops.retention_run(dry_run=True, workflow="ops_forky")).archived == 0
    dry = await ops.retention_run(dry_run=True, workflow="ops_flaky", scope="acme")
    assert (dry.archived, dry.purged) == (2, 0)  # a dry run counts what its archive phase would take
    report = await ops.retention_run(workflow="ops_flaky", scope="acme")
    assert (report.archived, report.purged) == (2, 2)
    left = {str(r["id"]) for r in await conn.fetch("SELECT id FROM stepstone.instances")}
    assert left.isdisjoint(acme) and set(other) <= left
    from tests.ops.test_cli_operations import as_json  # noqa: PLC0415 - the one CLI runner of these tests

    by_cli = await as_json(database_url, "retention", "run", "--scope", "default", "--workflow", "ops_flaky")
    assert (by_cli["archived"], by_cli["purged"]) == (3, 3)


async def test_a_window_past_a_thousand_years_or_negative_is_refused(engine: Engine, ops: Operations) -> None:
    """Such a window was stored as given (a negative one too), where the CLI refuses it; `stuck` with
    such an age failed on now() minus it ("timestamp out of range")."""
    before = await ops.retention_policies()
    for retain, purge in ((timedelta(days=999_999_999), None), (timedelta(days=-5), None),
                          (timedelta(days=1), timedelta(days=400_000))):
        with pytest.raises(InvalidInput, match="must be from 0 to a thousand years"):
            await ops.set_retention_policy("ops_flaky", "completed", retain, purge)
    assert await ops.retention_policies() == before
    with pytest.raises(InvalidInput, match="older_than must be from 0 to a thousand years"):
        await ops.stuck(timedelta(days=999_999_999))


async def test_a_policy_per_workflow_and_never_for_waiting(engine: Engine, ops: Operations) -> None:
    await ops.set_retention_policy("ops_flaky", "completed", timedelta(days=1), timedelta(0))
    await _completed(engine, 2)
    await engine.move_clock(2 * DAY)
    report = await ops.retention_run()
    assert (report.archived, report.purged) == (2, 2)  # purge_after 0: the same sweep purges


async def test_a_purge_is_held_back_by_an_unsent_or_dead_event(
    engine: Engine, ops: Operations, conn: asyncpg.Connection
) -> None:
    ids = await _completed(engine, 3)
    await conn.execute("INSERT INTO stepstone.outbox (event_id, instance_id, type, payload, created_at) "
                       "VALUES (gen_random_uuid(), $1, 'x', '{}', now())", ids[0])
    await conn.execute("INSERT INTO stepstone.outbox (event_id, instance_id, type, payload, created_at, dead_at) "
                       "VALUES (gen_random_uuid(), $1, 'x', '{}', now(), now())", ids[1])
    await engine.move_clock(32 * DAY)
    assert (await ops.retention_run()).archived == 3  # archiving hides; only a purge needs the guard
    await engine.move_clock(DAY + 60)
    dry = await ops.retention_run(dry_run=True)
    assert (dry.purged, dry.held_unsent, dry.held_dead) == (1, 1, 1)
    report = await ops.retention_run()
    assert (report.purged, report.held_unsent, report.held_dead) == (1, 1, 1)
    left = {str(r["id"]) for r in await conn.fetch("SELECT id FROM stepstone.instances")}
    assert left == {ids[0], ids[1]}
    # Published at last: the next sweep takes the instance (the event row is left to its own window).
    await conn.execute("UPDATE stepstone.outbox SET published_at = now() WHERE instance_id = $1", ids[0])
    assert (await ops.retention_run()).purged == 1


async def test_an_instance_with_an_active_command_is_left_alone(
    engine: Engine, ops: Operations, conn: asyncpg.Connection
) -> None:
    iid = await engine.client.start(workflows.flaky, {})
    await workflows.failed_for_good(engine, iid)
    assert (await engine.client.get(iid)).status == "FAILED"
    await engine.move_clock(181 * DAY)
    workflows.FAILURES[iid] = -1  # it would fail again: nothing runs it in this test anyway
    await engine.client.retry(iid)  # a RETRY now waits: the instance is active again
    report = await ops.retention_run()
    assert (report.archived, report.skipped_active) == (0, 0)  # RUNNING: no status class, not a candidate
    # Failed long ago as far as its row says, with the RETRY still queued: the command guard holds it.
    await conn.execute("UPDATE stepstone.instances SET status = 'FAILED', "
                       "updated_at = updated_at - interval '200 days' WHERE id = $1", iid)
    report = await ops.retention_run()
    assert (report.archived, report.skipped_active) == (0, 1)


async def test_one_sweep_at_a_time(engine: Engine, ops: Operations) -> None:
    holder = await ops.store.try_retention_lock()
    try:
        assert not (await ops.retention_run()).ran
    finally:
        await ops.store.release_retention_lock(holder)
    assert (await ops.retention_run()).ran


async def test_retention_beside_a_running_worker_purges_nothing_active(
    engine: Engine, ops: Operations, conn: asyncpg.Connection
) -> None:
    """Sweeps race a worker and an operator retrying old failed instances: a retried instance is either
    run to completion with its whole history, or was purged before its retry (which then finds
    nothing); never half. No statement waits on another (no deadlock); old completed ones all go."""
    for status_class in ("completed", "failed"):
        await ops.set_retention_policy("*", status_class, timedelta(days=1), timedelta(0))
    old = await _completed(engine, 30)
    failed = [await engine.client.start(workflows.flaky, {}) for _ in range(20)]
    await workflows.failed_for_good(engine, *failed)
    await engine.move_clock(2 * DAY)
    purged: list[int] = []
    retried: dict[str, bool] = {}

    async def sweep() -> None:
        for _ in range(6):
            report = await ops.retention_run(batch_size=4)
            if report.ran:
                purged.append(report.purged)
            await asyncio.sleep(0)

    async def operator() -> None:
        for iid in failed:
            report = await ops.retry([iid])
            retried[iid] = report.items[0].ok
            await asyncio.sleep(0)

    async def drive() -> None:
        for _ in range(10):
            await engine.run_until_idle()
            await asyncio.sleep(0)

    await asyncio.gather(drive(), sweep(), sweep(), operator())
    await engine.run_until_idle()
    rows = {str(r["id"]): r for r in await conn.fetch("SELECT id, status, history_seq FROM stepstone.instances")}
    assert not set(old) & set(rows)
    for iid in failed:
        if retried[iid]:
            assert rows[iid]["status"] == "COMPLETED", iid
            seqs = [r["seq"] for r in await conn.fetch(
                "SELECT seq FROM stepstone.history WHERE instance_id = $1 ORDER BY seq", iid)]
            assert seqs == list(range(1, rows[iid]["history_seq"] + 1))
        else:
            assert iid not in rows
            for table in ("positions", "commands", "history"):
                assert await conn.fetchval(f"SELECT count(*) FROM stepstone.{table} WHERE instance_id = $1", iid) == 0
    assert sum(purged) == 30 + sum(1 for ok in retried.values() if not ok)


async def test_the_worker_loop_sweeps_and_replicas_take_turns(engine: Engine, ops: Operations) -> None:
    from stepstone.ops.retention import RetentionLoop  # noqa: PLC0415 - the unit under test

    await ops.set_retention_policy("*", "completed", timedelta(days=1), timedelta(0))
    await _completed(engine, 5)
    await engine.move_clock(2 * DAY)
    loops = [RetentionLoop(ops.store, 3600), RetentionLoop(ops.store, 3600)]
    for loop in loops:
        await loop.start()
    try:
        await asyncio.wait_for(asyncio.gather(*(loop.swept.wait() for loop in loops)), 30)
    finally:
        for loop in loops:
            await loop.stop()
    reports = [loop.last for loop in loops if loop.last is not None]
    assert sum(r.purged for r in reports if r.ran) == 5


async def test_the_worker_loop_logs_only_what_it_did(
    engine: Engine, ops: Operations, caplog: pytest.LogCaptureFixture
) -> None:
    """A round that swept nothing logged a line of zeros at INFO, every round."""

    async def one_round() -> list[str]:
        caplog.clear()
        loop = RetentionLoop(ops.store, 3600)
        with caplog.at_level(logging.INFO, logger="stepstone.retention"):
            await loop.start()
            try:
                await asyncio.wait_for(loop.swept.wait(), 30)
            finally:
                await loop.stop()
        assert loop.last is not None and loop.last.ran
        return [r.getMessage() for r in caplog.records if r.name == "stepstone.retention"]

    assert await one_round() == []
    await ops.set_retention_policy("*", "completed", timedelta(days=1), timedelta(days=30))
    await _completed(engine, 3)
    await engine.move_clock(2 * DAY)
    assert await one_round() == ["retention: 3 archived"]


async def test_an_archived_instance_that_runs_again_shows_and_is_not_purged(
    engine: Engine, ops: Operations, conn: asyncpg.Connection
) -> None:
    iid = await engine.client.start(workflows.flaky, {})
    await workflows.failed_for_good(engine, iid)
    await engine.move_clock(181 * DAY)
    assert (await ops.retention_run()).archived == 1
    assert (await ops.find()).items == []
    await ops.retry([iid])
    await engine.run_until_idle()
    assert [i.id for i in (await ops.find()).items] == [iid]  # it ran again: no longer archived
    assert [i.archived_at for i in (await ops.find()).items] == [None]  # nor shown as archived
    assert (await engine.client.get(iid)).archived_at is None
    assert (await ops.detail(iid)).archived_at is None
    await engine.move_clock(2 * DAY)
    report = await ops.retention_run()
    assert (report.archived, report.purged) == (0, 0)  # completed two days ago: inside its 30 days
    await engine.move_clock(31 * DAY)
    assert (await ops.retention_run()).archived == 1  # archived afresh
    await engine.move_clock(DAY + 60)
    assert (await ops.retention_run()).purged == 1
    assert await conn.fetchval("SELECT count(*) FROM stepstone.instances") == 0


async def test_a_parent_with_a_child_still_running_is_kept(
    engine: Engine, ops: Operations, conn: asyncpg.Connection
) -> None:
    parent, other = await _completed(engine, 2)
    # A child that outlives its parent (not cancelled with it) will report to the parent's row.
    await conn.execute(
        "INSERT INTO stepstone.instances (id, definition_id, version, plan_hash, status, state, step, parent_id, "
        "created_at, updated_at) VALUES (gen_random_uuid(), 'ops_flaky', 1, "
        "(SELECT plan_hash FROM stepstone.definitions WHERE definition_id = 'ops_flaky' AND version = 1 LIMIT 1), "
        "'WAITING', '{}', 'work', $1, now(), now())", parent)
    await engine.move_clock(32 * DAY)
    report = await ops.retention_run()
    assert (report.archived, report.skipped_active) == (1, 1)
    archived = await conn.fetchval("SELECT id FROM stepstone.instances WHERE archived_at IS NOT NULL")
    assert str(archived) == other


async def test_client_list_leaves_archived_instances_out_as_find_does(engine: Engine, ops: Operations) -> None:
    """Client.list showed them (the CLI's list, find and the API's list did not), and a status no
    instance can have matched nothing instead of being refused."""
    iid = await engine.client.start(workflows.flaky, {})
    await workflows.failed_for_good(engine, iid)
    await engine.move_clock(181 * DAY)
    assert (await ops.retention_run()).archived == 1
    assert await engine.client.list() == []
    assert [r["id"] for r in await engine.client.list(include_archived=True)] == [iid]
    assert (await engine.client.get(iid)).archived_at is not None  # get (and show, GET /instances/{id}) say so
    with pytest.raises(InvalidInput, match="status must be one of"):
        await engine.client.list(status="failed")
    with pytest.raises(InvalidInput, match="status must be among"):
        InstanceFilter(status=("BOGUS",))


async def test_published_outbox_rows_take_only_the_default_window(ops: Operations) -> None:
    """A per-workflow outbox_published policy was stored and listed, but the sweep reads only the '*'
    one (outbox rows are swept for every workflow at once): it is refused, as is a purge window for a
    class that has no second stage."""
    with pytest.raises(InvalidInput, match="outbox_published takes only the '\\*' workflow") as refused:
        await ops.set_retention_policy("order", "outbox_published", timedelta(seconds=1))
    assert refused.value.what == "workflow"
    with pytest.raises(InvalidInput, match="published outbox rows have no purge window") as refused:
        await ops.set_retention_policy("*", "outbox_published", timedelta(days=1), timedelta(days=2))
    assert refused.value.what == "purge_after"
    assert not [p for p in await ops.retention_policies() if p["workflow"] == "order"]
    row = await ops.set_retention_policy("*", "outbox_published", timedelta(days=3))
    assert row["retain_for"] == timedelta(days=3)


async def test_a_policy_for_a_workflow_that_is_not_registered_is_refused(ops: Operations) -> None:
    """It was stored and listed, and no sweep would ever apply it (a typo keeps the default window)."""
    with pytest.raises(InvalidInput, match="no workflow 'nosuchwf' is registered") as refused:
        await ops.set_retention_policy("nosuchwf", "completed", timedelta(days=1))
    assert refused.value.what == "workflow"
    assert {p["workflow"] for p in await ops.retention_policies()} == {"*"}
    row = await ops.set_retention_policy("ops_flaky", "completed", timedelta(days=1))  # registered by the engine
    assert (row["workflow"], row["retain_for"]) == ("ops_flaky", timedelta(days=1))


def test_a_retention_loop_sweeps_at_most_once_a_second(ops: Operations) -> None:
    """Used directly (not through the worker's --retention-every, which checked), a 0 s interval swept in
    a busy loop."""
    for interval in (0.0, 0.5, float("nan")):
        with pytest.raises(InvalidInput, match="at least 1 s apart"):
            RetentionLoop(ops.store, interval)
    assert RetentionLoop(ops.store, 1.0).interval == 1.0


async def test_a_purge_takes_the_compensation_records_of_its_instances(
    engine: Engine, ops: Operations, conn: asyncpg.Connection
) -> None:
    """A saga's steps keep what their compensation would undo (`ctx.record`) in `compensations`: a purge
    deleted the instance, its positions, commands, history and tasks, and left those rows, with what
    they recorded, for ever."""
    done = await engine.client.start(workflows.booking, {"guest": "ada"})
    await engine.run_until_idle()
    kept = await engine.client.start(workflows.booking, {"guest": "bob"})
    await engine.run_until_idle()
    assert {(await engine.client.get(i)).status for i in (done, kept)} == {"COMPLETED"}
    await conn.execute("UPDATE stepstone.instances SET ended_at = ended_at + interval '40 days' WHERE id = $1", kept)
    await engine.move_clock(31 * DAY)
    assert (await ops.retention_run()).archived == 1
    await engine.move_clock(DAY + 60)
    assert (await ops.retention_run()).purged == 1
    rows = await conn.fetch("SELECT instance_id::text, recorded FROM stepstone.compensations ORDER BY id")
    assert [r["instance_id"] for r in rows] == [kept]


@pytest.mark.parametrize("ended", ["TIMED_OUT", "COMPENSATED"])
async def test_a_parent_whose_child_ended_timed_out_or_compensated_is_swept(
    engine: Engine, ops: Operations, conn: asyncpg.Connection, ended: str
) -> None:
    """A child that ended TIMED_OUT or COMPENSATED reports nothing more to its parent; the sweep counted
    only COMPLETED and CANCELLED children as ended, so it kept such a parent as active until the child
    itself was purged (180 days later by the seeded windows)."""
    [parent] = await _completed(engine, 1)
    await conn.execute(
        "INSERT INTO stepstone.instances (id, definition_id, version, plan_hash, status, state, step, parent_id, "
        "created_at, updated_at, ended_at) VALUES (gen_random_uuid(), 'ops_flaky', 1, "
        "(SELECT plan_hash FROM stepstone.definitions WHERE definition_id = 'ops_flaky' AND version = 1 LIMIT 1), "
        "$2, '{}', 'work', $1, now(), now(), now())", parent, ended)
    await engine.move_clock(32 * DAY)
    report = await ops.retention_run()
    assert (report.archived, report.skipped_active) == (1, 0)
    archived = await conn.fetchval("SELECT id FROM stepstone.instances WHERE archived_at IS NOT NULL")
    assert str(archived) == parent


async def test_a_waiting_child_is_kept_while_its_parent_waits_for_it(
    engine: Engine, ops: Operations, conn: asyncpg.Connection
) -> None:
    """The sweep looked at an instance's children, never at its parent: with a window for the child's
    waiting class, a child its parent waits for was archived and purged, and the parent waited for ever."""
    await ops.set_retention_policy("ops_relayed", "waiting", timedelta(days=1), timedelta(0))
    parent = await engine.client.start(workflows.holder, {"key": "h-1"})
    await engine.run_until_idle()
    child = str(await conn.fetchval("SELECT id FROM stepstone.instances WHERE parent_id = $1", parent))
    assert (await engine.client.get(child)).status == "WAITING"
    await engine.move_clock(2 * DAY)
    dry = await ops.retention_run(dry_run=True)
    assert (dry.archived, dry.skipped_active) == (0, 1)
    report = await ops.retention_run()
    assert (report.archived, report.purged, report.skipped_active) == (0, 0, 1)
    assert (await engine.client.get(child)).archived_at is None
    # The child goes on, and reports to its parent.
    await engine.client.signal(child, "go", {"n": 1})
    await engine.run_until_idle()
    await engine.client.publish_message("paid", "h-1", {"ref": "pay-1"})
    await engine.run_until_idle()
    info = await engine.client.get(parent)
    assert (info.status, info.state["ref"]) == ("COMPLETED", "pay-1")


async def test_an_abandoned_child_takes_its_own_window_once_its_parent_ended(
    engine: Engine, ops: Operations, conn: asyncpg.Connection
) -> None:
    """Once the parent has ended (cancelled here), nothing waits for the child: its own window applies."""
    await ops.set_retention_policy("ops_relayed", "waiting", timedelta(days=1), timedelta(0))
    parent = await engine.client.start(workflows.holder, {"key": "h-2"})
    await engine.run_until_idle()
    child = str(await conn.fetchval("SELECT id FROM stepstone.instances WHERE parent_id = $1", parent))
    await conn.execute("UPDATE stepstone.instances SET status = 'CANCELLED', ended_at = now() WHERE id = $1", parent)
    await engine.move_clock(2 * DAY)
    report = await ops.retention_run()
    assert (report.archived, report.purged, report.skipped_active) == (1, 1, 0)
    assert await conn.fetchval("SELECT count(*) FROM stepstone.instances WHERE id = $1", child) == 0
