"""The checker: reads the engine's tables and the ledger after a run and lists every violation.

Violations (each a string in ``report["violations"]``; an empty list means the run was correct):
  lost            an instance that is not COMPLETED
  step_twice      a (instance, visit) with more or fewer than one STEP_COMPLETED
  steps_missing   an instance whose number of STEP_COMPLETED is not its chain length
  history_gap     history seq not exactly 1..n, or n != instances.history_seq
  outbox          outbox events != committed emits (one per STEP_COMPLETED of an odd step, same key)
  lost_write      a committed step with no ledger row (its effect never happened)
  unexplained_dup a step visit with more than one effect not explained by a kill inside its effect ->
                  commit window (see ``explain``), a pause around it, a fenced commit of that visit by that
                  process, or a failed attempt (STEP_FAILED) retried
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import asyncpg

LEDGER_SQL = "SELECT key, pid, attempt, extract(epoch FROM at)::float8 AS at FROM chaos.ledger ORDER BY key, at"


SLACK_S = 0.5  # the ledger's clock (the database's) against the rig's, and the row's own commit


def explain(
    key: str,
    rows: list[tuple[int, float, int]],
    *,
    retried: set[tuple[str, int]],
    kill_at: dict[int, float],
    fenced_on: set[tuple[int, str, int]],
    paused: dict[int, list[tuple[float, float]]],
) -> list[str]:
    """Why each effect of one step visit (rows ordered by time) may have been repeated; "" when nothing
    explains it. A kill explains an effect only when it fell inside that effect's effect -> commit window:
    after the effect, and before the visit's next effect (the re-run another worker made once the
    killed process's lease expired). A kill at any other time says nothing about this effect."""
    instance, _, visit = key.split("/")
    reasons = []
    for n, (pid, at, attempt) in enumerate(rows):
        next_at = rows[n + 1][1] if n + 1 < len(rows) else None
        killed = kill_at.get(pid)
        if (key, attempt) in retried:
            reasons.append("handler_failed")  # the attempt raised; the step's retry policy ran it again
        elif killed is not None and next_at is not None and at - SLACK_S <= killed <= next_at + SLACK_S:
            reasons.append("killed")
        elif (pid, instance, int(visit)) in fenced_on:
            reasons.append("fenced")
        elif any(lo - SLACK_S <= at <= hi + SLACK_S for lo, hi in paused.get(pid, ())):
            reasons.append("paused")
        else:
            reasons.append("")
    return reasons


async def check(  # noqa: PLR0912 - one flat list of independent checks reads best
    conn: asyncpg.Connection,
    *,
    expected: int,
    kills: list[dict[str, Any]] = (),  # type: ignore[assignment]
    pauses: list[dict[str, Any]] = (),  # type: ignore[assignment]
    fenced: list[dict[str, Any]] = (),  # type: ignore[assignment]
    lease: float = 2.0,
) -> dict[str, Any]:
    violations: list[str] = []

    def bad(kind: str, detail: Any, limit: int = 5) -> None:
        violations.append(f"{kind}: {detail}"[:2000])

    statuses = dict(await conn.fetch("SELECT status, count(*) FROM stepstone.instances GROUP BY status"))
    total = sum(statuses.values())
    if total != expected or statuses.get("COMPLETED", 0) != expected:
        sample = await conn.fetch(
            "SELECT id, status, step, error FROM stepstone.instances WHERE status <> 'COMPLETED' LIMIT 5")
        bad("lost", f"{statuses} of {expected} expected; e.g. {[dict(r) for r in sample]}")

    twice = await conn.fetch(
        "SELECT instance_id, visit, count(*) AS n FROM stepstone.history WHERE kind = 'STEP_COMPLETED' "
        "GROUP BY 1, 2 HAVING count(*) <> 1")
    if twice:
        bad("step_twice", f"{len(twice)} visits, e.g. {[dict(r) for r in twice[:5]]}")

    missing = await conn.fetch(
        "SELECT i.id, i.definition_id, count(h.*) AS n FROM stepstone.instances i "
        "LEFT JOIN stepstone.history h ON h.instance_id = i.id AND h.kind = 'STEP_COMPLETED' "
        "GROUP BY i.id, i.definition_id "
        "HAVING count(h.*) <> split_part(i.definition_id, '-', 2)::int")
    if missing:
        bad("steps_missing", f"{len(missing)} instances, e.g. {[dict(r) for r in missing[:5]]}")

    gaps = await conn.fetch(
        "SELECT i.id, i.history_seq, count(h.*) AS n, min(h.seq) AS lo, max(h.seq) AS hi "
        "FROM stepstone.instances i LEFT JOIN stepstone.history h ON h.instance_id = i.id "
        "GROUP BY i.id, i.history_seq "
        "HAVING count(h.*) <> i.history_seq OR min(h.seq) <> 1 OR max(h.seq) <> i.history_seq")
    if gaps:
        bad("history_gap", f"{len(gaps)} instances, e.g. {[dict(r) for r in gaps[:5]]}")

    committed = await conn.fetchval("SELECT count(*) FROM stepstone.history WHERE kind = 'STEP_COMPLETED'")
    emitting = await conn.fetchval("SELECT count(*) FROM stepstone.history WHERE kind = 'STEP_COMPLETED' "
                                   "AND substr(step, 2)::int % 2 = 1")
    events = await conn.fetchval("SELECT count(*) FROM stepstone.outbox")
    unmatched = await conn.fetch(
        "WITH steps AS (SELECT instance_id || '/' || step || '/' || visit AS key FROM stepstone.history "
        "               WHERE kind = 'STEP_COMPLETED' AND substr(step, 2)::int % 2 = 1), "
        "     ev AS (SELECT payload->>'key' AS key, count(*) AS n FROM stepstone.outbox GROUP BY 1) "
        "SELECT coalesce(s.key, ev.key) AS key, ev.n FROM steps s FULL JOIN ev ON ev.key = s.key "
        "WHERE s.key IS NULL OR ev.key IS NULL OR ev.n <> 1 LIMIT 5")
    if events != emitting or unmatched:
        bad("outbox", f"{events} events for {emitting} committed emitting steps; e.g. {[dict(r) for r in unmatched]}")

    lost_writes = await conn.fetch(
        "SELECT h.instance_id, h.step, h.visit FROM stepstone.history h WHERE h.kind = 'STEP_COMPLETED' "
        "AND NOT EXISTS (SELECT 1 FROM chaos.ledger l "
        "                WHERE l.key = h.instance_id || '/' || h.step || '/' || h.visit) LIMIT 5")
    if lost_writes:
        bad("lost_write", [dict(r) for r in lost_writes])

    # Duplicate effects. Of the n invocations of a step visit, one committed; the other n-1 must each be
    # explained: its process was killed after the effect, paused around it, or had that visit's commit
    # fenced. The committer is not necessarily the last row (a zombie resumed after the takeover writes
    # its effect late and is then refused), so count the rows that cannot be explained: at most one per key.
    kill_at = {k["pid"]: k["at"] for k in kills}
    paused = defaultdict(list)
    for p in pauses:
        paused[p["pid"]].append((p["from"], p["to"]))
    fenced_on = {(f["pid"], f["instance"], int(f["visit"])) for f in fenced}
    failed_attempts = await conn.fetch(
        "SELECT instance_id::text || '/' || step || '/' || visit AS key, (data->>'attempt')::int AS attempt, "
        "       data->>'type' AS type, data->>'message' AS message "
        "FROM stepstone.history WHERE kind = 'STEP_FAILED'")
    retried = {(r["key"], r["attempt"]) for r in failed_attempts}
    by_key: dict[str, list[tuple[int, float, int]]] = defaultdict(list)
    for r in await conn.fetch(LEDGER_SQL):
        by_key[r["key"]].append((r["pid"], r["at"], r["attempt"]))
    duplicates = 0
    why: dict[str, int] = defaultdict(int)
    per_kill: dict[int, int] = defaultdict(int)
    unexplained: list[dict[str, Any]] = []
    for key, rows in by_key.items():
        if len(rows) < 2:
            continue
        duplicates += len(rows) - 1
        reasons = explain(key, rows, retried=retried, kill_at=kill_at, fenced_on=fenced_on, paused=paused)
        if reasons.count("") > 1:
            unexplained.append({"key": key, "rows": rows, "reasons": reasons})
        # Attribute the n-1 duplicates to the explained rows (the committer is one of the rest).
        explained = [(r, pid) for r, (pid, _, _) in zip(reasons, rows, strict=True) if r]
        for r, pid in explained[: len(rows) - 1]:
            why[r] += 1
            if r == "killed":
                per_kill[pid] += 1
    if unexplained:
        bad("unexplained_dup", f"{len(unexplained)} step visits, e.g. {unexplained[:3]}")

    # Stalls: the longest gap between consecutive history entries of an instance after its first step
    # (the gap before the first step is queueing behind the initial backlog, not recovery).
    stall = await conn.fetchrow(
        "WITH g AS (SELECT instance_id, kind, extract(epoch FROM at - lag(at) OVER w)::float8 AS gap, "
        "                  row_number() OVER w AS rn FROM stepstone.history "
        "           WINDOW w AS (PARTITION BY instance_id ORDER BY seq)) "
        "SELECT max(gap) AS worst, percentile_cont(0.99) WITHIN GROUP (ORDER BY gap) AS p99, "
        "       count(*) FILTER (WHERE gap > $1) AS over_lease "
        "FROM g WHERE rn > 2", lease)
    kills_n = len(kills)
    return {
        "instances": total,
        "statuses": statuses,
        "committed_steps": committed,
        "committed_emits": emitting,
        "outbox_events": events,
        "effects": sum(len(v) for v in by_key.values()),
        "duplicate_effects": duplicates,
        "duplicates_explained_by": dict(why),
        "kills": kills_n,
        "duplicates_per_kill": round(duplicates / kills_n, 3) if kills_n else None,
        "max_duplicates_of_one_kill": max(per_kill.values(), default=0),
        "failed_attempts": len(failed_attempts),
        "failed_attempt_errors": sorted({f"{r['type']}: {r['message']}"[:200] for r in failed_attempts})[:5],
        "longest_stall_s": round(stall["worst"] or 0.0, 3),
        "p99_step_gap_s": round(stall["p99"] or 0.0, 3),
        "step_gaps_over_lease": stall["over_lease"],
        "lease_s": lease,
        "violations": violations,
    }
