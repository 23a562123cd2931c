"""A branch whose handler kills its worker's process, for real (`chaoskill-3`: a fork of boom, a and b whose
join needs two; boom's step calls os._exit every time it runs), under `max_claims` 1.

The process dies with every command it held: boom's and, the first time, the siblings claimed beside it.
A crash counts on a command only by the claims in which it ran alone (core/dead_letter.py), so the
siblings, run alone after that first death, complete; the instances complete on their join; and nothing
but boom is ever dead-lettered (boom is, after its first death and one alone, unless the join closed its
branch first). Before, the first death dead-lettered every command the process held, at `max_claims` 1:
the siblings failed and with them the instances.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import asyncpg

from stepstone.client import Client
from stepstone.core.pin import pin_of
from stepstone.errors import WaitTimeout
from stepstone.store.postgres import PostgresStore
from tests._pg import PgServer
from tests.chaos import workflows
from tests.chaos.rig.fleet import Fleet, Proc
from tests.chaos.rig.scenarios import Target, scenario_database

SIZE = 3


async def _start(url: str) -> list[str]:
    store = await PostgresStore.open(url, max_size=4)
    try:
        await store.register(pin_of(workflows.KILL), workflows.KILL.plan.document())
        return [await Client(store, workflows.registry).start(workflows.KILL, {}) for _ in range(SIZE)]
    finally:
        await store.close()


async def test_a_branch_that_kills_its_process_dead_letters_no_sibling(pg_server: PgServer, tmp_path: Path) -> None:
    async with scenario_database(Target(pg_server.admin_url), "crash_siblings") as url:
        iids = await _start(url)
        # One worker process: the branches of an instance are claimed beside each other, in the process
        # their boom kills.
        fleet = Fleet(url, tmp_path, 1, lease=1.0, concurrency=4, poll=0.2,
                      env={workflows.PAUSE_ENV: "0.5", workflows.MAX_CLAIMS_ENV: "1"})
        fleet.start()
        deaths: list[Proc] = []
        conn = await asyncpg.connect(url)
        store = await PostgresStore.open(url, max_size=4)
        client = Client(store, workflows.registry)

        async def replace_the_dead() -> None:
            while True:  # boom kills the process: a new one takes its place
                proc = fleet.procs[0]
                await asyncio.to_thread(proc.popen.wait)
                proc.out.close()
                fleet.retired.append(proc)
                deaths.append(proc)
                fleet.spawn(0)

        replacing = asyncio.create_task(replace_the_dead())
        try:
            # Each instance ends in a worker process; its settle notification wakes the wait (the assertions
            # below say which did not end in time).
            with contextlib.suppress(WaitTimeout):
                await asyncio.gather(*(client.wait_for(iid, timeout=120) for iid in iids))
            replacing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await replacing
            statuses = dict(await conn.fetch("SELECT id::text, status FROM stepstone.instances"))
            dead = await conn.fetch(
                "SELECT c.position, count(*) AS n FROM stepstone.commands c WHERE c.state = 'DEAD' "
                "GROUP BY c.position ORDER BY c.position")
            siblings = await conn.fetch(
                "SELECT c.position, c.state, c.claims FROM stepstone.commands c "
                "WHERE c.position IN ('split/a', 'split/b') ORDER BY c.instance_id, c.position")
        finally:
            replacing.cancel()
            await client.detach()
            await store.close()
            await conn.close()
            await asyncio.to_thread(fleet.stop)
    assert {iid: statuses[iid] for iid in iids} == dict.fromkeys(iids, "COMPLETED")
    assert deaths, "boom never killed its process"
    assert {p.popen.returncode for p in deaths} == {workflows.BOOM_EXIT}
    assert set(fleet.crashed()) == {p.pid for p in deaths}  # no process died another way
    assert [r["position"] for r in dead] in ([], ["split/boom"])
    assert {(r["state"]) for r in siblings} == {"COMPLETE"} and len(siblings) == 2 * SIZE
    shared = sum(r["claims"] > 1 for r in siblings)
    assert shared, "no sibling shared a death with boom"
    print(f"crash kills: {len(deaths)} deaths, {shared} of {2 * SIZE} siblings shared one, "  # noqa: T201
          f"dead-lettered: {[(r['position'], r['n']) for r in dead]}")
