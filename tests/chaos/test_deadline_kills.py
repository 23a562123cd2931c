"""Instance and step deadlines firing while worker processes are SIGKILLed (`chaosdue-3`: s1, compensated by
undo_s1; s2 with a one-second step deadline whose `on_deadline` is `late`; then s3). Three kinds of start, on
3 workers of 24 slots, kills paced by history entries:

  in time     a deadline a minute away, no lingering: every one COMPLETED (by s2, or by `late` when a kill
              held s2 past its step deadline)
  step due    s2 lingers 6 s after its effect: its step deadline fires while the handler runs, the handler's
              commit is refused, the position goes to `late`, and the instance COMPLETES (also when a kill
              held the timer up until the handler returned: the commit finds the deadline passed, writes
              nothing of s2 and interrupts it there, or, the timer being held, is refused)
  instance due  started once the workers run, a deadline 2.5 s after the start, s3 lingering 8 s: the
              deadline fires (mid-s3, or earlier when a kill held the instance), the saga undoes s1 if it
              committed, and the instance ends TIMED_OUT (also when no worker has claimed the deadline's
              timer by the time s3 returns: its commit, which would complete the instance, finds the
              deadline passed and times the instance out there, or, the timer being held, is refused)

A second run crowds the slots: 2 workers of 2 slots, 12 instances whose s2 lingers 3 s past its 1 s step
deadline, so that no slot is free for a deadline's timer while s2 runs; every s2 commit must be refused,
and every instance take `late`.

The outcome is judged from the tables, not from the kind: an instance ends TIMED_OUT only after its
deadline (its deadline entry is at or after `deadline_at`), exactly once, and then only if it had not
completed; no instance COMPLETED at or after its `deadline_at`, by the database clock (before migration 0061
a step that ended the instance committed whatever the time while the deadline's timer had not fired: a kill
held the timer up, or every slot was busy, and instances completed up to 14 s past their deadline); a
COMPLETED instance's deadline timer never fired; the saga undoes exactly the committed s1; no command is
left open (the deadline timer settled or fired); nothing commits after the terminal entry, and no handler
effect comes after it but the one step visit that was in flight; a step deadline passes only for a visit of
s2 that did not commit, once, and leads to `late`, and is recorded passed only for such a visit; no s2 visit
commits after its step deadline. Every committed step once with its effect, every repeated effect explained
by a kill or a refused commit; histories gapless. How late the fired deadlines were is printed.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from stepstone.client import Client
from stepstone.core.pin import pin_of
from stepstone.store.postgres import PostgresStore
from tests._pg import PgServer
from tests.chaos import workflows
from tests.chaos.rig import checker
from tests.chaos.rig.fleet import Fleet
from tests.chaos.rig.scenarios import Probe, Target, fleet_run, kill_as_commits_go, scenario_database, wait_for

IN_TIME, STEP_DUE, INSTANCE_DUE = 12, 12, 12
SIZE = IN_TIME + STEP_DUE + INSTANCE_DUE
WORKERS = 3
# Slots for every instance at once, and in any one worker for its lingering handlers and the timers beside
# them: a deadline fires when a worker claims its timer, which needs a free slot (see the docstring). With 12,
# one worker once took all 12 starts of the third kind in one claim while the other two were being replaced:
# its slots were full of lingering s3 handlers, no deadline fired, and all 12 completed past their deadline.
SLOTS = 24
KILLS = 8
# History entries between two kills: entries, not step commits, since the deadlines fire after most steps
# committed (the timers, the compensations and the ends are entries too), and the kills must fall among them.
KILL_EVERY = 25
SLACK_S = checker.SLACK_S  # the ledger's rows against the history's transaction times
DUE = workflows.DUE


async def _start(client: Client, kind: str, n: int, state: workflows.Due, deadline: float) -> dict[str, str]:
    """`n` instances of one kind."""
    return {await client.start(DUE, state, deadline=deadline): kind for _ in range(n)}


async def test_deadlines_under_kills_time_out_exactly_what_was_late(pg_server: PgServer, tmp_path: Path) -> None:
    rng = random.Random(23)  # noqa: S311 - a reproducible kill schedule
    async with scenario_database(Target(pg_server.admin_url), "deadlines") as url:
        store = await PostgresStore.open(url, max_size=4)
        await store.register(pin_of(DUE), DUE.plan.document())
        client = Client(store, workflows.registry)
        kinds = await _start(client, "in time", IN_TIME, workflows.Due(), 60)
        kinds |= await _start(client, "step due", STEP_DUE, workflows.Due(slow2=6.0), 60)
        fleet = Fleet(url, tmp_path, WORKERS, lease=1.0, concurrency=SLOTS, poll=0.2)
        fleet.start()
        probe = Probe(url)
        settled, entries = _settled(probe), _entries(probe)
        deadline = time.monotonic() + 150
        async with fleet_run(fleet, probe, store.close):
            # The third kind once the workers run: its deadline is counted from its start, and a deadline
            # that passes before any worker is up tests the start-up, not the kills.
            assert await wait_for(lambda: _at_least(probe, "STEP_COMPLETED", IN_TIME), deadline, every=0.02)
            kinds |= await _start(client, "instance due", INSTANCE_DUE, workflows.Due(slow3=8.0), 2.5)
            await kill_as_commits_go(fleet, probe, settled, kills=KILLS, every=KILL_EVERY, rng=rng,
                                     deadline=deadline, count=entries)
            assert await wait_for(settled, deadline), "instances left moving"
        seen = await _checked(url, fleet)
    statuses, counts, late = seen.statuses, seen.counts, seen.late
    assert set(statuses) == set(kinds)
    outcome: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for iid, kind in kinds.items():
        outcome[kind][statuses[iid]] += 1
    assert outcome["in time"] == {"COMPLETED": IN_TIME}, dict(outcome["in time"])
    assert outcome["step due"] == {"COMPLETED": STEP_DUE}, dict(outcome["step due"])
    # s3 lingers past the deadline: whether a worker claims the timer first or the commit of s3 meets the
    # deadline, every one times out (before migration 0061, beside the full suite, as few as 4 of 12 did).
    assert outcome["instance due"] == {"TIMED_OUT": INSTANCE_DUE}, dict(outcome["instance due"])
    checker.assert_repeats_explained(seen.ledger, fleet.kills, retried=seen.retried, fenced=seen.fenced)
    assert len(fleet.kills) >= KILLS // 2
    # The deadlines fired where the test means them to (at least once each; a kill or a busy machine can hold
    # a timer up, see the docstring): a step deadline under a running handler, an instance deadline after s1
    # committed (so that the saga undid something).
    assert counts.get("STEP_DEADLINE_EXCEEDED", 0) >= 1, counts
    assert counts.get("STEP_COMPENSATED", 0) >= 1, counts
    print(f"deadline kills: {len(fleet.kills)} kills, {counts}, outcomes {_plain(outcome)}, "  # noqa: T201
          f"completed past their deadline {late['completed_late']} (at most {late['completed_by']:.2f} s), "
          f"deadlines fired at most {late['fired_late']:.2f} s late")


# With every slot busy, none is free for a step deadline's timer: 2 workers of 2 slots, 12 instances whose s2
# lingers 3 s past its 1 s deadline. Each held handler returns with its deadline's timer still queued.
CROWDED, CROWDED_WORKERS, CROWDED_SLOTS, CROWDED_KILLS, CROWDED_EVERY = 12, 2, 2, 3, 15


async def test_step_deadlines_hold_with_every_slot_busy_under_kills(pg_server: PgServer, tmp_path: Path) -> None:
    """Every s2 outlives its step deadline, and no slot is free to fire the deadline's timer while it runs:
    s2's commit must not go on (before migration 0057 it did, to s3, and `late` never ran); each instance
    takes `late` instead, and records the deadline passed once, for that s2 visit."""
    rng = random.Random(29)  # noqa: S311 - a reproducible kill schedule
    async with scenario_database(Target(pg_server.admin_url), "crowded") as url:
        store = await PostgresStore.open(url, max_size=4)
        await store.register(pin_of(DUE), DUE.plan.document())
        client = Client(store, workflows.registry)
        kinds = await _start(client, "crowded", CROWDED, workflows.Due(slow2=3.0), 600)
        fleet = Fleet(url, tmp_path, CROWDED_WORKERS, lease=1.0, concurrency=CROWDED_SLOTS, poll=0.2)
        fleet.start()
        probe = Probe(url)
        settled = _settled(probe)
        deadline = time.monotonic() + 150
        async with fleet_run(fleet, probe, store.close):
            await kill_as_commits_go(fleet, probe, settled, kills=CROWDED_KILLS, every=CROWDED_EVERY, rng=rng,
                                     deadline=deadline, count=_entries(probe))
            assert await wait_for(settled, deadline), "instances left moving"
        seen = await _checked(url, fleet)
    assert seen.statuses == dict.fromkeys(kinds, "COMPLETED"), seen.statuses
    # No s2 committed (the checks above: none past its deadline, and each lingers past it), so every
    # instance went to `late` through its step deadline, once.
    assert seen.counts.get("STEP_DEADLINE_EXCEEDED", 0) == CROWDED, seen.counts
    checker.assert_repeats_explained(seen.ledger, fleet.kills, retried=seen.retried, fenced=seen.fenced)
    print(f"crowded deadline kills: {len(fleet.kills)} kills, {seen.counts}")  # noqa: T201


@dataclass(frozen=True)
class _Seen:
    """What a run left, read once its invariants (`_NOTHING`) held."""

    statuses: dict[str, str]
    counts: dict[str, int]
    late: Any
    ledger: list[Any]
    retried: set[tuple[str, int]]
    fenced: set[tuple[int, str, str, int]]


async def _checked(url: str, fleet: Fleet) -> _Seen:
    fenced = checker.fenced_visits(fleet.stats())
    conn = await asyncpg.connect(url)
    try:
        await checker.assert_none(conn, _NOTHING)
        return _Seen(
            statuses=dict(await conn.fetch("SELECT id::text, status FROM stepstone.instances")),
            counts=dict(await conn.fetch(_COUNT_BY_KIND)),
            late=await conn.fetchrow(_LATE),
            ledger=await conn.fetch(checker.LEDGER_SQL),
            retried={(r["key"], r["attempt"]) for r in await conn.fetch(checker.RETRIED)},
            fenced=fenced,
        )
    finally:
        await conn.close()


def _settled(probe: Probe) -> Callable[[], Awaitable[bool]]:
    """Every instance ended, and no command left to run."""
    async def settled() -> bool:
        return not await probe.fetchval(
            "SELECT count(*) FROM stepstone.instances WHERE status NOT IN ('COMPLETED', 'TIMED_OUT')") \
            and not await probe.fetchval(
                "SELECT count(*) FROM stepstone.commands WHERE state IN ('PENDING', 'DEFERRED', 'CLAIMED')")
    return settled


def _entries(probe: Probe) -> Callable[[], Awaitable[int]]:
    async def entries() -> int:
        return int(await probe.fetchval("SELECT count(*) FROM stepstone.history"))
    return entries


async def _at_least(probe: Probe, kind: str, n: int) -> bool:
    return int(await probe.fetchval("SELECT count(*) FROM stepstone.history WHERE kind = $1", kind)) >= n


def _plain(outcome: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {kind: dict(counts) for kind, counts in outcome.items()}


_COUNT_BY_KIND = ("SELECT kind, count(*) FROM stepstone.history WHERE kind IN ("
                  "'STEP_DEADLINE_PASSED', 'STEP_DEADLINE_EXCEEDED', 'DEADLINE_PASSED', 'STEP_COMPENSATED', "
                  "'INSTANCE_TIMED_OUT') GROUP BY 1")
_LATE = (
    "SELECT count(*) FILTER (WHERE i.status = 'COMPLETED' AND i.ended_at > i.deadline_at) AS completed_late, "
    "  coalesce(extract(epoch FROM max(i.ended_at - i.deadline_at) FILTER (WHERE i.status = 'COMPLETED')), 0) "
    "  AS completed_by, "
    "  coalesce(extract(epoch FROM max(h.at - i.deadline_at)), 0) AS fired_late "
    "FROM stepstone.instances i LEFT JOIN stepstone.history h ON h.instance_id = i.id AND h.kind = 'DEADLINE_PASSED'")


# An instance's terminal entry: the one that ended it.
_TERMINAL = ("(SELECT h.seq, h.at FROM stepstone.history h WHERE h.instance_id = i.id "
             "AND h.kind IN ('INSTANCE_COMPLETED', 'INSTANCE_TIMED_OUT') ORDER BY h.seq LIMIT 1)")
_S1_DONE = ("(SELECT count(*) FROM stepstone.history h WHERE h.instance_id = i.id AND h.kind = 'STEP_COMPLETED' "
            "AND h.step = 's1')")
_UNDONE = "(SELECT count(*) FROM stepstone.history h WHERE h.instance_id = i.id AND h.kind = 'STEP_COMPENSATED')"


_NOTHING = {
    "instances not ended once": (
        "SELECT i.id, i.status, count(h.*) FILTER (WHERE h.kind IN ('INSTANCE_COMPLETED', 'INSTANCE_TIMED_OUT')) "
        "FROM stepstone.instances i LEFT JOIN stepstone.history h ON h.instance_id = i.id GROUP BY i.id, i.status "
        "HAVING i.status NOT IN ('COMPLETED', 'TIMED_OUT') "
        "OR count(h.*) FILTER (WHERE h.kind = 'INSTANCE_COMPLETED') <> (i.status = 'COMPLETED')::int "
        "OR count(h.*) FILTER (WHERE h.kind = 'INSTANCE_TIMED_OUT') <> (i.status = 'TIMED_OUT')::int"),
    "deadlines recorded other than once per timed-out instance": (
        "SELECT i.id, i.status, count(h.*) FROM stepstone.instances i LEFT JOIN stepstone.history h "
        "ON h.instance_id = i.id AND h.kind = 'DEADLINE_PASSED' GROUP BY i.id, i.status "
        "HAVING count(h.*) <> (i.status = 'TIMED_OUT')::int"),
    # A commit that would end an instance after its deadline, while the deadline's timer had not fired, did
    # (before migration 0061): the deadline wins there now, as its timer would.
    "instances completed at or after their deadline": (
        "SELECT i.id, i.deadline_at, i.ended_at FROM stepstone.instances i "
        "WHERE i.status = 'COMPLETED' AND i.ended_at >= i.deadline_at"),
    "deadlines fired before their time": (
        "SELECT i.id, i.deadline_at, h.at FROM stepstone.instances i JOIN stepstone.history h "
        "ON h.instance_id = i.id AND h.kind = 'DEADLINE_PASSED' WHERE h.at < i.deadline_at"),
    "instance deadline timers of completed instances that fired, or of timed-out ones that did not": (
        "SELECT i.id, i.status, c.state FROM stepstone.instances i JOIN stepstone.commands c "
        "ON c.instance_id = i.id AND c.kind = 'TIMER' AND c.name = 'deadline' "
        "WHERE (c.state = 'COMPLETE') <> (i.status = 'TIMED_OUT')"),
    "commands left open (a deadline timer not consumed)": (
        "SELECT instance_id, kind, state FROM stepstone.commands "
        "WHERE state IN ('PENDING', 'DEFERRED', 'CLAIMED', 'PARKED')"),
    "timed-out instances whose committed s1 was not undone once, or undone without committing": (
        f"SELECT i.id, {_S1_DONE} AS s1, {_UNDONE} AS undone FROM stepstone.instances i "
        f"WHERE i.status = 'TIMED_OUT' AND {_S1_DONE} <> {_UNDONE}"),
    "compensations of instances that completed": (
        "SELECT h.instance_id FROM stepstone.history h JOIN stepstone.instances i ON i.id = h.instance_id "
        "WHERE i.status = 'COMPLETED' AND h.kind = 'STEP_COMPENSATED'"),
    "compensation effects missing for a compensation committed, or without one": (
        "SELECT i.id FROM stepstone.instances i WHERE (SELECT count(DISTINCT l.key) FROM chaos.ledger l "
        f"WHERE l.instance_id = i.id AND l.key LIKE '%/compensate/%') <> {_UNDONE}"),
    "entries after the terminal one": (
        f"SELECT i.id, t.seq, i.history_seq FROM stepstone.instances i CROSS JOIN LATERAL {_TERMINAL} t "
        "WHERE i.history_seq <> t.seq"),
    "handler effects after the terminal entry, of a visit that committed or beside another visit": (
        "SELECT i.id, array_agg(DISTINCT l.key) AS keys FROM stepstone.instances i CROSS JOIN LATERAL "
        f"{_TERMINAL} t JOIN chaos.ledger l ON l.instance_id = i.id AND l.at > t.at + interval '{SLACK_S} s' "
        "AND l.key NOT LIKE '%/compensate/%' GROUP BY i.id "
        "HAVING count(DISTINCT l.key) > 1 OR bool_or(EXISTS (SELECT 1 FROM stepstone.history h "
        "  WHERE h.instance_id = i.id AND h.kind = 'STEP_COMPLETED' "
        "  AND l.key = h.instance_id::text || '/' || h.step || '/' || h.visit))"),
    "step deadlines exceeded twice, or for a visit of s2 that committed": (
        "SELECT p.instance_id, p.visit, count(*) FROM stepstone.history p WHERE p.kind = 'STEP_DEADLINE_EXCEEDED' "
        "GROUP BY 1, 2 HAVING count(*) > 1 OR EXISTS (SELECT 1 FROM stepstone.history h "
        "WHERE h.instance_id = p.instance_id AND h.kind = 'STEP_COMPLETED' AND h.step = 's2' AND h.visit = p.visit)"),
    # s1's commit enters s2 and schedules its deadline's timer at the same database instant: an s2 commit
    # later than that plus the deadline went on past it (before migration 0057, whenever no slot was free
    # for the timer, or a kill held it: the commit did not look at the deadline, only the timer's claim did).
    "s2 visits committed after their step deadline": (
        "SELECT b.instance_id, b.visit, b.at - a.at AS after FROM stepstone.history a JOIN stepstone.history b "
        "ON b.instance_id = a.instance_id AND b.kind = 'STEP_COMPLETED' AND b.step = 's2' "
        "WHERE a.kind = 'STEP_COMPLETED' AND a.step = 's1' "
        f"AND b.at > a.at + interval '{workflows.STEP_DEADLINE.total_seconds()} s'"),
    # A timer that fires after its visit was left in time finds the position gone on and records nothing
    # (before migration 0056 the core wrote STEP_DEADLINE_PASSED before the store looked).
    "step deadlines passed for a visit that committed": (
        "SELECT h.instance_id, h.step, h.visit FROM stepstone.history h WHERE h.kind = 'STEP_DEADLINE_PASSED' "
        "AND EXISTS (SELECT 1 FROM stepstone.history c WHERE c.instance_id = h.instance_id "
        "AND c.kind = 'STEP_COMPLETED' AND c.step = h.step AND c.visit = h.visit)"),
    "step deadlines exceeded without passing first": (
        "SELECT p.instance_id, p.visit FROM stepstone.history p WHERE p.kind = 'STEP_DEADLINE_EXCEEDED' "
        "AND NOT EXISTS (SELECT 1 FROM stepstone.history h WHERE h.instance_id = p.instance_id "
        "AND h.kind = 'STEP_DEADLINE_PASSED' AND h.step = p.step AND h.visit = p.visit AND h.seq < p.seq)"),
    "completed instances that did not take exactly one of s2 and late": (
        "SELECT i.id FROM stepstone.instances i WHERE i.status = 'COMPLETED' AND "
        "(SELECT count(*) FROM stepstone.history h WHERE h.instance_id = i.id AND h.kind = 'STEP_COMPLETED' "
        " AND h.step IN ('s2', 'late')) <> 1"),
    "a late step without its step deadline exceeded": (
        "SELECT h.instance_id FROM stepstone.history h WHERE h.kind = 'STEP_COMPLETED' AND h.step = 'late' "
        "AND NOT EXISTS (SELECT 1 FROM stepstone.history p WHERE p.instance_id = h.instance_id "
        "AND p.kind = 'STEP_DEADLINE_EXCEEDED' AND p.step = 's2')"),
    "committed steps without their effect": checker.LOST_WRITES,
    "step visits committed twice": checker.STEP_TWICE,
    "histories with a gap": checker.HISTORY_GAPS,
}
