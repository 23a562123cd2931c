"""Worker processes SIGKILLed between a task's reservation and its segment: `complete_task` has committed
the reservation (task COMPLETING, completion command recorded); a worker claims that command and its
segment commit is held (the test holds the task rows), then the worker is SIGKILLed and its server
connection is gone before the rows are let go. Another worker takes the command over once the lease
expires: every task completes exactly once, every instance moves on with its decision exactly once
(one TASK_COMPLETED, one s1 effect), and the completion was committed by a worker that was not killed.

And buffered messages handed on while worker processes are SIGKILLed (migrations 0074, 0077): each taken
by a wait that a signal sent before it then wins, so that it goes on to the wait of its key opened
afterwards (or back to the buffer, where that wait finds it): each applied once, none lost. Beside them, messages
published straight to an open wait, in one transaction with the signal that then wins it (migration 0087): they
go on the same way."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import asyncpg

from stepstone.client import Client
from stepstone.core.pin import pin_of
from stepstone.errors import Unavailable
from stepstone.store.postgres import PostgresStore
from tests._pg import PgServer
from tests.chaos import workflows
from tests.chaos.rig import checker
from tests.chaos.rig.fleet import Fleet
from tests.chaos.rig.scenarios import Probe, Target, fleet_run, kill_as_commits_go, scenario_database, wait_for

SIZE = 8
WORKERS = 2
APP = "taskkill-w"  # the application_name of slot N's connections is APP + N


def _slot_url(url: str, slot: int) -> str:
    # A server backend blocked on a lock notices its dead client only when it checks the socket: the
    # check interval makes the killed worker's open transaction abort (and roll back) at once.
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}application_name={APP}{slot}&client_connection_check_interval=50"


async def _count(probe: Probe, sql: str) -> int:
    return int(await probe.fetchval(sql))


async def test_a_worker_killed_between_reservation_and_segment_completes_the_task_once(
    pg_server: PgServer, tmp_path: Path
) -> None:
    async with scenario_database(Target(pg_server.admin_url), "taskkills") as url:
        store = await PostgresStore.open(url, max_size=4)
        client = Client(store, workflows.registry)
        await store.register(pin_of(workflows.TASK), workflows.TASK.plan.document())
        ids = [await client.start(workflows.TASK, workflows.Ticket(key=f"k{n}")) for n in range(SIZE)]
        fleet = Fleet(url, tmp_path, WORKERS, lease=1.0, concurrency=4, poll=0.2,
                      slot_urls={s: _slot_url(url, s) for s in range(WORKERS)})
        fleet.start()
        probe = Probe(url)
        holder = await asyncpg.connect(url)
        deadline = time.monotonic() + 90
        async with fleet_run(fleet, probe, holder.close, store.close):
            assert await wait_for(lambda: _opened(probe), deadline)
            for slot in range(WORKERS):
                fleet.pause(slot)  # nobody claims a completion before the rows are held
            page = await client.tasks(mode="all", limit=100)
            assert len(page.tasks) == SIZE
            commands = {}
            for task in page.tasks:
                done = await client.complete_task(task.id, "approve", None, actor="rig", admin=True,
                                                  idempotency_key=f"kill/{task.id}")
                commands[task.id] = done.command_id
            tx = holder.transaction()
            await tx.start()
            await holder.execute("SELECT 1 FROM stepstone.tasks FOR UPDATE")  # every segment commit waits here
            for slot in range(WORKERS):
                fleet.resume(slot)
            me = await holder.fetchval("SELECT pg_backend_pid()")
            blocked_sql = ("SELECT array_agg(DISTINCT application_name) FROM pg_stat_activity "
                           f"WHERE {me} = ANY(pg_blocking_pids(pid)) AND application_name LIKE '{APP}%'")
            assert await wait_for(lambda: _true(probe, blocked_sql), deadline, every=0.02)
            names = await probe.fetchval(blocked_sql)
            killed = [fleet.kill(int(name.removeprefix(APP))) for name in names]  # mid-segment, commit held
            gone = (f"SELECT count(*) = 0 FROM pg_stat_activity WHERE application_name = ANY('{{{','.join(names)}}}') "
                    f"AND backend_start < to_timestamp({min(k['at'] for k in killed)})")
            assert await wait_for(lambda: _true(probe, gone), deadline, every=0.02), "the killed backends linger"
            await tx.rollback()  # the rows are free: the survivors' commits, and the takeovers, go on
            assert await wait_for(lambda: _approved(probe), deadline)
            for n in range(SIZE):  # buffered when s1's commit has not opened the wait yet (its effect came first)
                await client.publish_message(workflows.RECEIPT, f"k{n}", {"key": f"k{n}"}, message_id=f"r{n}",
                                             ttl=60)
            assert await wait_for(lambda: _completed(probe), deadline)
        conn = await asyncpg.connect(url)
        try:
            assert await conn.fetchval("SELECT count(*) FROM stepstone.tasks WHERE status = 'COMPLETED'") == SIZE
            per_task = await conn.fetch("SELECT data->>'task_id' AS tid, count(*) AS n FROM stepstone.history "
                                        "WHERE kind = 'TASK_COMPLETED' GROUP BY 1")
            assert sorted(r["n"] for r in per_task) == [1] * SIZE
            s1 = await conn.fetch("SELECT instance_id, count(*) AS n FROM chaos.ledger WHERE step = 's1' GROUP BY 1")
            assert {str(r["instance_id"]): r["n"] for r in s1} == dict.fromkeys(ids, 1)
            states = await conn.fetch("SELECT state->>'key' AS key, state->>'got' AS got, status "
                                      "FROM stepstone.instances")
            assert all(r["status"] == "COMPLETED" and r["got"] == r["key"] for r in states), states
            claimed_by = await conn.fetch("SELECT claimed_by FROM stepstone.commands WHERE id = ANY($1::bigint[])",
                                          list(commands.values()))
        finally:
            await conn.close()
    dead = {k["pid"] for k in killed}
    takeovers = [r["claimed_by"] for r in claimed_by if int(r["claimed_by"].rsplit(":", 1)[1]) in dead]
    assert killed, "no worker was caught inside a task completion's segment"
    assert takeovers == [], takeovers  # what a killed worker had claimed, another committed
    print(f"task kills: {len(killed)} workers killed mid-segment")  # noqa: T201


async def _opened(probe: Probe) -> bool:
    return await _count(probe, "SELECT count(*) FROM stepstone.tasks WHERE status = 'OPEN'") == SIZE


async def _true(probe: Probe, sql: str) -> bool:
    return bool(await probe.fetchval(sql))


async def _approved(probe: Probe) -> bool:
    return await _count(probe, "SELECT count(*) FROM chaos.ledger WHERE step = 's1'") >= SIZE and \
        await _count(probe, "SELECT count(*) FROM stepstone.tasks WHERE status = 'COMPLETED'") == SIZE


async def _completed(probe: Probe) -> bool:
    return await _count(probe, "SELECT count(*) FROM stepstone.instances WHERE status = 'COMPLETED'") == SIZE


HANDED = 24  # keys: one buffered message, one instance that takes and leaves it, one that then gets it
STRAIGHT = 12  # keys: one instance waiting, sent `go` and the message (delivered to it) in one transaction


async def _go_and_publish(client: Client, url: str, iid: str, key: str) -> None:
    """`go` and the message, in one transaction: both queued for the open wait, `go` first, so that the message,
    delivered to that wait, finds it left."""
    conn = await asyncpg.connect(url)
    try:
        while True:
            try:
                async with conn.transaction():
                    await client.signal(iid, workflows.GO, {}, connection=conn)
                    published = await client.publish_message(workflows.RECEIPT, key, {"key": key}, ttl=600,
                                                             message_id=f"hand-{key}", connection=conn)
            except Unavailable:  # a worker's commit held the instance: nothing was written
                continue
            assert [d.instance_id for d in published.deliveries] == [iid], published
            return
    finally:
        await conn.close()


async def test_buffered_messages_handed_on_under_kills_are_applied_once(pg_server: PgServer, tmp_path: Path) -> None:
    rng = random.Random(7)  # noqa: S311 - a reproducible schedule of kills
    async with scenario_database(Target(pg_server.admin_url), "handkills") as url:
        store = await PostgresStore.open(url, max_size=4)
        client = Client(store, workflows.registry)
        await store.register(pin_of(workflows.HANDED), workflows.HANDED.plan.document())
        fleet = Fleet(url, tmp_path, 3, lease=1.0, concurrency=4, poll=0.2)
        probe = Probe(url)

        async def completed() -> bool:
            return await _count(probe, "SELECT count(*) FROM stepstone.instances WHERE status = 'COMPLETED'") \
                == 2 * (HANDED + STRAIGHT)

        deadline = time.monotonic() + 150
        async with fleet_run(fleet, probe, store.close):
            leavers = []
            for n in range(HANDED):  # the leaver's wait takes the message; its GO, sent before, wins
                await client.publish_message(workflows.RECEIPT, f"h{n}", {"key": f"h{n}"}, message_id=f"hand-{n}",
                                             ttl=600)
                leavers.append(await client.start(workflows.HANDED, workflows.Ticket(key=f"h{n}")))
                await client.signal(leavers[-1], workflows.GO, {})
            straight = [await client.start(workflows.HANDED, workflows.Ticket(key=f"p{n}")) for n in range(STRAIGHT)]
            fleet.start()
            killing = asyncio.ensure_future(kill_as_commits_go(fleet, probe, completed, kills=6, every=8, rng=rng,
                                                               deadline=deadline))
            try:
                assert await wait_for(lambda: _true(probe, _TAKEN), deadline, every=0.02), "a wait took nothing"
                assert await wait_for(lambda: _true(probe, _STRAIGHT_WAITING), deadline, every=0.02), "no wait"
                for n, iid in enumerate(straight):
                    await _go_and_publish(client, url, iid, f"p{n}")
                # A wait of each key, opened once the leaver's wait took its message (while it goes on).
                takers = [await client.start(workflows.HANDED, workflows.Ticket(key=f"h{n}")) for n in range(HANDED)]
                takers += [await client.start(workflows.HANDED, workflows.Ticket(key=f"p{n}"))
                           for n in range(STRAIGHT)]
                assert await wait_for(completed, deadline), "not every instance completed"
            finally:
                await killing
        conn = await asyncpg.connect(url)
        try:
            await checker.assert_none(conn, _HANDED_ONCE)
            got = {str(r["id"]): r["got"] for r in await conn.fetch("SELECT id, state->>'got' AS got, "
                                                                     "state->>'key' AS key FROM stepstone.instances")}
            returned = await conn.fetchval(_RETURNED)
        finally:
            await conn.close()
    assert {got[iid] for iid in leavers + straight} == {workflows.GO}, got
    assert [got[iid] for iid in takers] == [f"h{n}" for n in range(HANDED)] + [f"p{n}" for n in range(STRAIGHT)], got
    assert returned >= HANDED + STRAIGHT, returned  # each message went through the hand-on at least once
    assert len(fleet.kills) >= 3, fleet.kills
    print(f"hand-on kills: {len(fleet.kills)} kills, {returned} messages returned")  # noqa: T201


# Every leaver's wait took its message from the buffer: a MESSAGE command for each (behind its GO).
_TAKEN = (f"SELECT count(DISTINCT payload->>'message_id') = {HANDED} FROM stepstone.commands "
          "WHERE kind = 'MESSAGE' AND payload->>'message_id' LIKE 'hand-%'")
# Every instance sent the message straight waits at its wait.
_STRAIGHT_WAITING = (f"SELECT count(*) = {STRAIGHT} FROM stepstone.positions p JOIN stepstone.instances i "
                     "ON i.id = p.instance_id WHERE i.state->>'key' LIKE 'p%' "
                     "AND p.status = 'WAITING' AND p.step = 'w'")
_RETURNED = ("SELECT count(*) FROM stepstone.commands WHERE kind = 'MESSAGE' AND payload->>'message_id' LIKE 'hand-%' "
             "AND state IN ('STALE', 'REJECTED')")
_HANDED_ONCE = {
    "messages not applied exactly once (DELIVERED, one MESSAGE_CORRELATED naming it)":
        "SELECT m.message_id, m.status, count(h.*) FROM stepstone.messages m LEFT JOIN stepstone.history h "
        "ON h.kind = 'MESSAGE_CORRELATED' AND h.data->>'message_id' = m.message_id "
        "GROUP BY m.message_id, m.status HAVING m.status <> 'DELIVERED' OR count(h.*) <> 1",
    "committed steps without their effect": checker.LOST_WRITES,
    "step visits committed twice": checker.STEP_TWICE,
    "histories with a gap": checker.HISTORY_GAPS,
}
