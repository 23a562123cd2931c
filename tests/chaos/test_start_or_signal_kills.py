"""Signal-with-start while worker processes are SIGKILLed (docs/messages.md, "Signal-with-start"): for each
of 30 business keys, three callers call `start_or_signal` on `chaosgather-3` at once, each with its own
`n` and dedup key, and each repeats its call (an answer it did not trust) with the same dedup key. Half
of the keys are called before any worker runs, the other half while workers die.

What must hold afterwards: one instance per key; each COMPLETED having taken every caller's signal once
(`got` holds 0, 1 and 2, in any order); for each key exactly one caller was told `started` (both of its
answers), and every repeat answered its first call's command; each step visit committed once with its
effect in the ledger; histories gapless.
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
from tests.chaos.rig.scenarios import Probe, Target, fleet_run, kill_as_commits_go, progressed, scenario_database

KEYS = 30
WORKERS = 3
KILLS = 6
KILL_EVERY = 20  # step commits between two kills: the kills follow the run's progress, not the clock
CALLERS = range(workflows.GATHER)


async def _callers(client: Client, key: str, rng: random.Random) -> list[tuple[int, bool, int, int, str]]:
    """The key's callers at once, each calling twice with its own dedup key: (n, started, first, repeat,
    instance)."""
    async def call(n: int) -> tuple[int, bool, int, int, str]:
        await asyncio.sleep(0) if rng.random() < 0.5 else None  # callers interleave differently per key
        first = await client.start_or_signal(workflows.GATHERING, key, workflows.GO, {"n": n}, input={},
                                             dedup_key=f"{key}/{n}")
        repeat = await client.start_or_signal(workflows.GATHERING, key, workflows.GO, {"n": n}, input={},
                                              dedup_key=f"{key}/{n}")
        assert repeat.started == first.started and repeat.instance_id == first.instance_id, (first, repeat)
        return n, first.started, first.command_id, repeat.command_id, first.instance_id

    return list(await asyncio.gather(*(call(n) for n in CALLERS)))


async def test_signal_with_start_under_kills_starts_once_and_applies_each_call_once(
        pg_server: PgServer, tmp_path: Path) -> None:
    rng = random.Random(47)  # noqa: S311 - a reproducible schedule of kills and callers
    async with scenario_database(Target(pg_server.admin_url), "gather") as url:
        store = await PostgresStore.open(url, max_size=8)
        fleet = Fleet(url, tmp_path, WORKERS, lease=1.0, concurrency=4, poll=0.2, env={workflows.PAUSE_ENV: "0.05"})
        probe = Probe(url)

        async def completed() -> bool:
            return int(await probe.fetchval(
                "SELECT count(*) FROM stepstone.instances WHERE status = 'COMPLETED'")) == KEYS

        deadline = time.monotonic() + 150
        client = Client(store, workflows.registry)
        async with fleet_run(fleet, probe, client.close):
            keys = [f"k{n}" for n in range(KEYS)]
            early, late = keys[: KEYS // 2], keys[KEYS // 2 :]
            answers = {key: await _callers(client, key, rng) for key in early}
            fleet.start()
            killing = asyncio.create_task(kill_as_commits_go(
                fleet, probe, completed, kills=KILLS, every=KILL_EVERY, rng=rng, deadline=deadline))
            commits = await probe.commits()
            for key in late:  # the calls spread over the run while workers die: a key every two step commits
                answers[key] = await _callers(client, key, rng)
                commits = await progressed(probe, commits, 2, deadline, completed)
            for iid in {call[4] for calls in answers.values() for call in calls}:  # each one's settle notification
                await client.wait_for(iid, timeout=max(1.0, deadline - time.monotonic()))
            await killing
        conn = await asyncpg.connect(url)
        try:
            await checker.assert_none(conn, _NOTHING)
            instances = await conn.fetch("SELECT business_key, state FROM stepstone.instances")
        finally:
            await conn.close()
    assert sorted(r["business_key"] for r in instances) == sorted(answers)
    for key, calls in answers.items():
        assert [started for _, started, _, _, _ in calls].count(True) == 1, (key, calls)
        assert all(first == repeat for _, _, first, repeat, _ in calls), (key, calls)
    assert len(fleet.kills) >= 3
    print(f"start_or_signal kills: {len(fleet.kills)} kills, {KEYS} keys, "  # noqa: T201
          f"{2 * len(CALLERS) * KEYS} calls, one instance a key")


_NOTHING = {
    "instances that did not take each caller's signal once": (
        "SELECT id, state FROM stepstone.instances WHERE status <> 'COMPLETED' OR "
        "(SELECT array_agg(n::int ORDER BY n::int) FROM jsonb_array_elements_text(state->'got') AS g(n)) "
        f"<> ARRAY{list(CALLERS)}"),
    "instances without exactly one SIGNAL_APPLIED a caller": (
        "SELECT i.id, count(h.*) FROM stepstone.instances i LEFT JOIN stepstone.history h "
        "ON h.instance_id = i.id AND h.kind = 'SIGNAL_APPLIED' GROUP BY i.id "
        f"HAVING count(h.*) <> {len(CALLERS)}"),
    "committed steps without their effect": checker.LOST_WRITES,
    "step visits committed twice": checker.STEP_TWICE,
    "histories with a gap": checker.HISTORY_GAPS,
}
