"""Signals while worker processes are SIGKILLed: instances that wait twice for the signal `go`
(`chaossig-2`) get each of their two signals twice under one dedup key (a caller repeating a call whose
answer it did not trust): half of them get both signals before any worker runs (each queues behind the
step before its wait), the other half each signal once its wait is open, the repeat at once or once the
instance has left that wait (at the next wait, after the end), while workers die.

What must hold afterwards: every instance COMPLETED, having taken its signals in the order they were
sent (`got == [1, 2]`), each applied once (two SIGNAL_APPLIED, nothing applied twice), each of its steps
committed once with its effect in the ledger, and its history gapless.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import asyncpg

from stepstone.client import Client
from stepstone.store.postgres import PostgresStore
from tests._pg import PgServer
from tests.chaos import workflows
from tests.chaos.rig import checker
from tests.chaos.rig.fleet import Fleet
from tests.chaos.rig.scenarios import Probe, Target, fleet_run, kill_as_commits_go, scenario_database, wait_for

SIZE = 80
WORKERS = 3
KILLS = 6
KILL_EVERY = 20  # step commits between two kills: the kills follow the run's progress, not the clock


async def _send(client: Client, iid: str, n: int) -> None:
    await client.signal(iid, workflows.GO, {"n": n}, dedup_key=f"go-{n}")


async def _early(client: Client, iid: str) -> int:
    """Both signals, each twice, at once: before the workers start, so before either wait opens."""
    for n in (1, 1, 2, 2):
        await _send(client, iid, n)
    return 4


async def _late(client: Client, iid: str, rng: random.Random) -> int:
    """Each signal once its wait is open (the instance cannot pass it without), twice: the repeat at once
    (while the instance still waits, or its next step runs) or once the instance has left that wait (at
    the next wait, or ended), as the sender's coin falls."""
    for n in (1, 2):
        async def at(n: int = n) -> bool:
            return (await client.get(iid)).step == f"w{n}"

        async def left(n: int = n) -> bool:
            return (await client.get(iid)).step != f"w{n}"

        assert await wait_for(at, time.monotonic() + 120, every=0.02), f"{iid} never reached w{n}"
        await _send(client, iid, n)
        if rng.random() < 0.5:
            assert await wait_for(left, time.monotonic() + 120, every=0.02), f"{iid} never left w{n}"
        await _send(client, iid, n)
    return 4


async def test_signals_under_kills_are_applied_once_each_in_order(pg_server: PgServer, tmp_path: Path) -> None:
    rng = random.Random(5)  # noqa: S311 - a reproducible schedule of kills and signals
    async with scenario_database(Target(pg_server.admin_url), "signals") as url:
        store = await PostgresStore.open(url, max_size=4)
        fleet = Fleet(url, tmp_path, WORKERS, lease=1.0, concurrency=4, poll=0.2,
                      env={workflows.PAUSE_ENV: "0.05"})
        probe = Probe(url)

        async def completed() -> bool:
            return int(await probe.fetchval("SELECT count(*) FROM stepstone.instances WHERE status = 'COMPLETED'")) \
                == SIZE

        deadline = time.monotonic() + 150
        async with fleet_run(fleet, probe, store.close):
            client = Client(store, workflows.registry)
            ids = [await client.start(workflows.SIGNALLED, {}) for _ in range(SIZE)]
            early, late = ids[: SIZE // 2], ids[SIZE // 2 :]
            sent = sum([await _early(client, iid) for iid in early])
            fleet.start()
            senders = [random.Random(rng.random()) for _ in late]  # noqa: S311 - each sender its own coin
            sending = asyncio.gather(*(_late(client, iid, r) for iid, r in zip(late, senders, strict=True)))
            await kill_as_commits_go(fleet, probe, completed, kills=KILLS, every=KILL_EVERY, rng=rng,
                                     deadline=deadline)
            calls = sent + sum(await sending)
            assert await wait_for(completed, deadline), "not every instance completed"
        conn = await asyncpg.connect(url)
        try:
            await checker.assert_none(conn, _NOTHING)
            before_wait = await conn.fetchval(_EARLY)
        finally:
            await conn.close()
    assert calls == 4 * SIZE
    assert len(fleet.kills) >= 3
    # The early half's signals were all sent before their waits opened; so, often, were the late half's repeats.
    assert before_wait >= SIZE, f"only {before_wait} applied signals were sent before their wait opened"
    print(f"signal kills: {len(fleet.kills)} kills, {calls} signal calls, {before_wait} of {2 * SIZE} applied "  # noqa: T201
          "signals sent before their wait opened")


# Applied signals that were sent before their wait opened (queued behind the step before it, or the start).
_EARLY = (
    "SELECT count(*) FROM stepstone.history a "
    "JOIN stepstone.commands c ON c.id = (a.data->>'command')::bigint "
    "JOIN stepstone.history s ON s.instance_id = a.instance_id AND s.kind = 'STEP_COMPLETED' "
    "  AND s.step = CASE a.step WHEN 'w1' THEN 's1' ELSE 's2' END "
    "WHERE a.kind = 'SIGNAL_APPLIED' AND c.created_at < s.at")


_NOTHING = {
    "instances whose signals were not taken once each, in order":
        "SELECT id, state FROM stepstone.instances WHERE state->'got' <> '[1, 2]'::jsonb",
    "instances without exactly two SIGNAL_APPLIED":
        "SELECT i.id, count(h.*) FROM stepstone.instances i LEFT JOIN stepstone.history h "
        "ON h.instance_id = i.id AND h.kind = 'SIGNAL_APPLIED' GROUP BY i.id HAVING count(h.*) <> 2",
    "step visits not committed exactly once (s1, s2, s3)":
        "SELECT i.id, count(h.*) FROM stepstone.instances i LEFT JOIN stepstone.history h "
        "ON h.instance_id = i.id AND h.kind = 'STEP_COMPLETED' GROUP BY i.id "
        "HAVING count(h.*) <> 3 OR count(DISTINCT h.step) <> 3",
    "committed steps without their effect": checker.LOST_WRITES,
    "step visits committed twice": checker.STEP_TWICE,
    "histories with a gap": checker.HISTORY_GAPS,
}

