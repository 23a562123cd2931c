"""The checker: reads the engine's tables and the ledger after a run and lists every violation.

Violations (each a string in ``report["violations"]``; an empty list means the run was correct):
  lost            an instance that is not COMPLETED (children included), or not `expected` top-level ones
  step_twice      a (instance, position, step, visit) with more than one STEP_COMPLETED (a branch step too)
  steps_missing   an instance whose number of STEP_COMPLETED is not its workflow's (chain length; 2 per
                  branch + 1 for a fan-out; 3 for a parent)
  join_twice      a fork visit (FORK_STARTED) without exactly one JOINED, a JOINED without its fork visit,
                  or a fan-out that never forked
  branch_joined   a fork visit whose BRANCH_JOINED count is not its number of branches
  lost_update     a fan-out whose shared `done` does not hold every branch's two writes
  child_twice     a parent child-step visit (CHILD_STARTED) without exactly one child instance with that
                  parent_id, position and visit (and that id), a child with no such visit, or a parent
                  without exactly one child
  parent_resumed  a parent without exactly one CHILD_COMPLETED, or whose s3 did not see its child's id
  task_once       a task instance (chaostask) without exactly one task, COMPLETED, with exactly one
                  TASK_COMPLETED in its history, or a task left OPEN / COMPLETING
  message_once    a task instance without exactly one MESSAGE_CORRELATED, whose s2 did not see its own
                  key's message, or a message delivered more than once (each key's message is published
                  twice with one message id: the repeat must change nothing)
  open_position   a COMPLETED instance with a position still open, or instances.branches <> 0
  history_gap     history seq not exactly 1..n, or n != instances.history_seq
  outbox          outbox events != committed emits (one per STEP_COMPLETED of an odd step, same key)
  lost_write      a committed step with no ledger row (its effect never happened)
  unexplained_dup a step visit with more than one effect not explained by a kill inside its effect ->
                  commit window (see ``explain``), a pause around it, a fenced commit of that position's
                  visit by that process, or a failed attempt (STEP_FAILED) retried
  fenced_repeats  a step visit's runs explained by fenced commits outnumber those commits by more than
                  the one run that committed (each fenced commit explains the one run it came from)

A step visit's key is the handler's idempotency key: `instance/step/visit` at the root and
`instance/position/step/visit` in a branch (the position is a path such as `fan/3`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import asyncpg

from tests.chaos import workflows

LEDGER_SQL = "SELECT key, pid, attempt, extract(epoch FROM at)::float8 AS at FROM chaos.ledger ORDER BY key, at"
# A history row's step-visit key, as the handler's idempotency key spells it.
KEY = "(h.instance_id::text || coalesce(nullif('/' || h.position, '/'), '') || '/' || h.step || '/' || h.visit)"
EXPECTED_STEPS = (
    "CASE split_part(i.definition_id, '-', 1) "
    "WHEN 'chaos' THEN split_part(i.definition_id, '-', 2)::int "
    f"WHEN 'chaosfan' THEN {workflows.FAN_BRANCH_STEPS} * split_part(i.definition_id, '-', 2)::int + 1 "
    "WHEN 'chaosparent' THEN 3 "
    f"WHEN 'chaostask' THEN {workflows.TASK_STEPS} END")


def split_key(key: str) -> tuple[str, str, str, int]:
    """(instance, position, step, visit) of a step-visit key."""
    parts = key.split("/")
    return parts[0], "/".join(parts[1:-2]), parts[-2], int(parts[-1])


# Step visits committed more than once, and histories that are not exactly 1..history_seq: the checks
# every scenario makes, and the kill tests of single features too (through `assert_none`).
STEP_TWICE = (
    "SELECT instance_id, coalesce(position, '') AS position, step, visit, count(*) AS n FROM stepstone.history "
    "WHERE kind = 'STEP_COMPLETED' GROUP BY 1, 2, 3, 4 HAVING count(*) <> 1")
HISTORY_GAPS = (
    "SELECT i.id, i.history_seq, count(h.*) AS n, min(h.seq) AS lo, max(h.seq) AS hi "
    "FROM stepstone.instances i LEFT JOIN stepstone.history h ON h.instance_id = i.id "
    "GROUP BY i.id, i.history_seq "
    "HAVING count(h.*) <> i.history_seq OR min(h.seq) <> 1 OR max(h.seq) <> i.history_seq")


# A committed step with no ledger row: its effect never happened.
LOST_WRITES = (
    "SELECT h.instance_id, h.position, h.step, h.visit FROM stepstone.history h WHERE h.kind = 'STEP_COMPLETED' "
    f"AND NOT EXISTS (SELECT 1 FROM chaos.ledger l WHERE l.key = {KEY}) LIMIT 5")


async def assert_none(conn: asyncpg.Connection, queries: Mapping[str, str]) -> None:
    """Each query lists what breaks one invariant (its key): every one must come back empty."""
    for what, sql in queries.items():
        rows = await conn.fetch(sql)
        assert not rows, f"{what}: {len(rows)}, e.g. {[dict(r) for r in rows[:5]]}"


SLACK_S = 0.5  # the ledger's clock (the database's) against the rig's, and the row's own commit


def explain(
    key: str,
    rows: list[tuple[int, float, int]],
    *,
    retried: set[tuple[str, int]],
    kill_at: dict[int, float],
    fenced_on: Mapping[tuple[int, str, str, int], int],
    paused: dict[int, list[tuple[float, float]]],
) -> list[str]:
    """Why each effect of one step visit (rows ordered by time) may have been repeated; "" when nothing
    explains it. A kill explains an effect only when it fell inside that effect's effect -> commit window:
    after the effect, and before the visit's next effect (the re-run another worker made once the
    killed process's lease expired). A kill at any other time says nothing about this effect."""
    instance, position, _, visit = split_key(key)
    reasons = []
    for n, (pid, at, attempt) in enumerate(rows):
        next_at = rows[n + 1][1] if n + 1 < len(rows) else None
        killed = kill_at.get(pid)
        if (key, attempt) in retried:
            reasons.append("handler_failed")  # the attempt raised; the step's retry policy ran it again
        elif killed is not None and next_at is not None and at - SLACK_S <= killed <= next_at + SLACK_S:
            reasons.append("killed")
        elif fenced_on.get((pid, instance, position, visit)):
            reasons.append("fenced")
        elif any(lo - SLACK_S <= at <= hi + SLACK_S for lo, hi in paused.get(pid, ())):
            reasons.append("paused")
        else:
            reasons.append("")
    return reasons


# The (step-visit key, attempt) of every attempt that failed and was retried.
RETRIED = (f"SELECT {KEY} AS key, (h.data->>'attempt')::int AS attempt FROM stepstone.history h "
           "WHERE h.kind = 'STEP_FAILED'")


def fenced_visits(stats: list[dict[str, Any]]) -> set[tuple[int, str, str, int]]:
    """(pid, instance, position, visit) of every commit the fleet's workers had refused (Fleet.stats())."""
    return {(s["pid"], f["instance"], f.get("position") or "", int(f["visit"]))
            for s in stats for f in s.get("fenced_log", [])}


def assert_repeats_explained(ledger: list[Any], kills: list[dict[str, Any]], *, retried: set[tuple[str, int]],
                             fenced: set[tuple[int, str, str, int]]) -> None:
    """Of one step visit's effects (`ledger`: LEDGER_SQL's rows), every one but the committed one explained:
    a kill in its effect -> commit window, a failed attempt retried, or a commit of that visit refused (a
    deadline or a cancel took its lease)."""
    by_key: dict[str, list[tuple[int, float, int]]] = defaultdict(list)
    for r in ledger:
        by_key[r["key"]].append((r["pid"], r["at"], r["attempt"]))
    fenced_on = dict.fromkeys(fenced, 1)
    # A compensation's key names its record, not the saga position's visit its fenced commit names: a
    # compensation run is explained by any refused commit of its process on the instance's saga position.
    saga_fenced = {(pid, instance) for pid, instance, position, _ in fenced if position == "$saga"}
    kill_at = {k["pid"]: k["at"] for k in kills}
    unexplained = []
    for key, rows in by_key.items():
        if len(rows) > 1:
            reasons = explain(key, rows, retried=retried, kill_at=kill_at, fenced_on=fenced_on, paused={})
            if "/compensate/" in key:
                instance = key.split("/", 1)[0]
                reasons = [r or ("fenced" if (pid, instance) in saga_fenced else "")
                           for r, (pid, _, _) in zip(reasons, rows, strict=True)]
            if reasons.count("") > 1:
                unexplained.append({"key": key, "rows": rows, "reasons": reasons})
    assert not unexplained, f"effects repeated without a kill or a refused commit: {unexplained[:3]}"


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
    top = await conn.fetchval("SELECT count(*) FROM stepstone.instances WHERE parent_id IS NULL")
    children = total - top
    if top != expected or statuses.get("COMPLETED", 0) != total:
        sample = await conn.fetch(
            "SELECT id, definition_id, status, step, error FROM stepstone.instances WHERE status <> 'COMPLETED' "
            "LIMIT 5")
        bad("lost", f"{statuses} for {top} top-level of {expected} expected and {children} children; "
                    f"e.g. {[dict(r) for r in sample]}")

    twice = await conn.fetch(STEP_TWICE)
    if twice:
        bad("step_twice", f"{len(twice)} step visits, e.g. {[dict(r) for r in twice[:5]]}")

    missing = await conn.fetch(
        f"SELECT i.id, i.definition_id, count(h.*) AS n, {EXPECTED_STEPS} AS expected FROM stepstone.instances i "
        "LEFT JOIN stepstone.history h ON h.instance_id = i.id AND h.kind = 'STEP_COMPLETED' "
        "GROUP BY i.id, i.definition_id "
        f"HAVING count(h.*) IS DISTINCT FROM {EXPECTED_STEPS}")
    if missing:
        bad("steps_missing", f"{len(missing)} instances, e.g. {[dict(r) for r in missing[:5]]}")

    await _branches_and_children(conn, bad)
    await _tasks_and_messages(conn, bad)

    gaps = await conn.fetch(HISTORY_GAPS)
    if gaps:
        bad("history_gap", f"{len(gaps)} instances, e.g. {[dict(r) for r in gaps[:5]]}")

    committed = await conn.fetchval("SELECT count(*) FROM stepstone.history WHERE kind = 'STEP_COMPLETED'")
    emitting = await conn.fetchval("SELECT count(*) FROM stepstone.history WHERE kind = 'STEP_COMPLETED' "
                                   "AND substr(step, 2)::int % 2 = 1")
    events = await conn.fetchval("SELECT count(*) FROM stepstone.outbox")
    unmatched = await conn.fetch(
        f"WITH steps AS (SELECT {KEY} AS key FROM stepstone.history h "
        "               WHERE h.kind = 'STEP_COMPLETED' AND substr(h.step, 2)::int % 2 = 1), "
        "     ev AS (SELECT payload->>'key' AS key, count(*) AS n FROM stepstone.outbox GROUP BY 1) "
        "SELECT coalesce(s.key, ev.key) AS key, ev.n FROM steps s FULL JOIN ev ON ev.key = s.key "
        "WHERE s.key IS NULL OR ev.key IS NULL OR ev.n <> 1 LIMIT 5")
    if events != emitting or unmatched:
        bad("outbox", f"{events} events for {emitting} committed emitting steps; e.g. {[dict(r) for r in unmatched]}")

    lost_writes = await conn.fetch(LOST_WRITES)
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
    fenced_on: dict[tuple[int, str, str, int], int] = defaultdict(int)  # how many commits of it were fenced
    for f in fenced:
        fenced_on[(f["pid"], f["instance"], f.get("position", ""), int(f["visit"]))] += 1
    failed_attempts = await conn.fetch(
        f"SELECT {KEY} AS key, (h.data->>'attempt')::int AS attempt, "
        "       h.data->>'type' AS type, h.data->>'message' AS message "
        "FROM stepstone.history h WHERE h.kind = 'STEP_FAILED'")
    retried = {(r["key"], r["attempt"]) for r in failed_attempts}
    by_key: dict[str, list[tuple[int, float, int]]] = defaultdict(list)
    for r in await conn.fetch(LEDGER_SQL):
        by_key[r["key"]].append((r["pid"], r["at"], r["attempt"]))
    duplicates = 0
    why: dict[str, int] = defaultdict(int)
    per_kill: dict[int, int] = defaultdict(int)
    unexplained: list[dict[str, Any]] = []
    over_fenced: list[dict[str, Any]] = []
    for key, rows in by_key.items():
        if len(rows) < 2:
            continue
        duplicates += len(rows) - 1
        instance, position, _, visit = split_key(key)
        reasons = explain(key, rows, retried=retried, kill_at=kill_at, fenced_on=fenced_on, paused=paused)
        if reasons.count("") > 1:
            unexplained.append({"key": key, "rows": rows, "reasons": reasons})
        # A fenced commit explains the one handler run it came from, not more. A process's runs beyond
        # its fenced commits of that visit can only be the one run that committed (the process may
        # have claimed the visit again after losing its lease), and only when no unexplained run is.
        runs: dict[int, int] = defaultdict(int)
        for r, (pid, _, _) in zip(reasons, rows, strict=True):
            if r == "fenced":
                runs[pid] += 1
        excess = sum(max(0, n - fenced_on[(pid, instance, position, visit)]) for pid, n in runs.items())
        if excess + reasons.count("") > 1:
            over_fenced.append({"key": key, "rows": rows, "reasons": reasons,
                                "fenced": {pid: fenced_on[(pid, instance, position, visit)] for pid in runs}})
        # Attribute the n-1 duplicates to the explained rows (the committer is one of the rest).
        explained = [(r, pid) for r, (pid, _, _) in zip(reasons, rows, strict=True) if r]
        for r, pid in explained[: len(rows) - 1]:
            why[r] += 1
            if r == "killed":
                per_kill[pid] += 1
    if unexplained:
        bad("unexplained_dup", f"{len(unexplained)} step visits, e.g. {unexplained[:3]}")
    if over_fenced:
        bad("fenced_repeats", f"{len(over_fenced)} step visits, e.g. {over_fenced[:3]}")

    # Stalls: the longest gap between consecutive history entries of a chain after its first step
    # (the gap before the first step is queueing behind the initial backlog, not recovery). Fan-outs
    # and parents are left out: their branches' and children's first commands join the back of that
    # backlog too, so their gaps measure queueing (reported apart as the longest such wait).
    stall_sql = (
        "WITH g AS (SELECT h.instance_id, extract(epoch FROM h.at - lag(h.at) OVER w)::float8 AS gap, "
        "                  row_number() OVER w AS rn FROM stepstone.history h "
        "           JOIN stepstone.instances i ON i.id = h.instance_id AND i.definition_id {} '^chaos-[0-9]+$' "
        "           WINDOW w AS (PARTITION BY h.instance_id ORDER BY h.seq)) "
        "SELECT max(gap) AS worst, percentile_cont(0.99) WITHIN GROUP (ORDER BY gap) AS p99, "
        "       count(*) FILTER (WHERE gap > $1) AS over_lease "
        "FROM g WHERE rn > 2")
    stall = await conn.fetchrow(stall_sql.format("~"), lease)
    queued = await conn.fetchrow(stall_sql.format("!~"), lease)
    kills_n = len(kills)
    return {
        "instances": total,
        "top_level": top,
        "children": children,
        "fan_outs": await conn.fetchval(
            "SELECT count(*) FROM stepstone.instances WHERE definition_id LIKE 'chaosfan-%'"),
        "branch_steps": await conn.fetchval("SELECT count(*) FROM stepstone.history "
                                            "WHERE kind = 'STEP_COMPLETED' AND position <> ''"),
        "joins": await conn.fetchval("SELECT count(*) FROM stepstone.history WHERE kind = 'JOINED'"),
        "task_instances": await conn.fetchval(
            "SELECT count(*) FROM stepstone.instances WHERE definition_id = $1", workflows.TASK.id),
        "task_completions": await conn.fetchval("SELECT count(*) FROM stepstone.history WHERE kind = 'TASK_COMPLETED'"),
        "messages_correlated": await conn.fetchval(
            "SELECT count(*) FROM stepstone.history WHERE kind = 'MESSAGE_CORRELATED'"),
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
        "longest_gap_fanouts_and_parents_s": round(queued["worst"] or 0.0, 3),
        "lease_s": lease,
        "violations": violations,
    }


async def _branches_and_children(conn: asyncpg.Connection, bad: Any) -> None:
    """Fork/join and child workflows: the join fires once per fork visit, every branch is joined, no
    branch write is lost, a child is started once per child-step visit, and its parent resumes once."""
    joins = await conn.fetch(
        "WITH f AS (SELECT instance_id, coalesce(position, '') AS pos, visit, count(*) AS forks "
        "           FROM stepstone.history WHERE kind = 'FORK_STARTED' GROUP BY 1, 2, 3), "
        "     j AS (SELECT instance_id, coalesce(position, '') AS pos, visit, count(*) AS joins "
        "           FROM stepstone.history WHERE kind = 'JOINED' GROUP BY 1, 2, 3) "
        "SELECT instance_id, pos, visit, f.forks, j.joins FROM f FULL JOIN j USING (instance_id, pos, visit) "
        "WHERE f.forks IS DISTINCT FROM 1 OR j.joins IS DISTINCT FROM 1 "
        "UNION ALL "
        "SELECT i.id, NULL, NULL, 0, NULL FROM stepstone.instances i WHERE i.definition_id LIKE 'chaosfan-%' "
        "AND NOT EXISTS (SELECT 1 FROM stepstone.history h WHERE h.instance_id = i.id AND h.kind = 'FORK_STARTED')")
    if joins:
        bad("join_twice", f"{len(joins)} fork visits, e.g. {[dict(r) for r in joins[:5]]}")
    joined = await conn.fetch(
        "SELECT f.instance_id, f.visit, (f.data->>'branches')::int AS branches, count(b.*) AS joined "
        "FROM stepstone.history f LEFT JOIN stepstone.history b ON b.instance_id = f.instance_id "
        "  AND b.kind = 'BRANCH_JOINED' AND b.visit = f.visit "
        "  AND coalesce(b.position, '') = coalesce(f.position, '') "
        "WHERE f.kind = 'FORK_STARTED' GROUP BY f.instance_id, f.visit, f.data "
        "HAVING count(b.*) <> (f.data->>'branches')::int")
    if joined:
        bad("branch_joined", f"{len(joined)} fork visits, e.g. {[dict(r) for r in joined[:5]]}")
    lost_updates = await conn.fetch(
        "SELECT i.id, i.state FROM stepstone.instances i WHERE i.definition_id LIKE 'chaosfan-%' "
        "AND i.status = 'COMPLETED' AND (SELECT count(*) FILTER (WHERE d.value = '2'::jsonb) || '/' || count(*) "
        "     FROM jsonb_each(i.state->'done') d) <> jsonb_array_length(i.state->'items') || '/' "
        "                                             || jsonb_array_length(i.state->'items')")
    if lost_updates:
        bad("lost_update", f"{len(lost_updates)} fan-outs, e.g. {[dict(r) for r in lost_updates[:3]]}")
    children = await conn.fetch(
        "WITH s AS (SELECT instance_id, coalesce(position, '') AS pos, visit, count(*) AS started, "
        "                  min(data->>'child_id') AS child_id "
        "           FROM stepstone.history WHERE kind = 'CHILD_STARTED' GROUP BY 1, 2, 3), "
        "     c AS (SELECT parent_id AS instance_id, coalesce(parent_position, '') AS pos, parent_visit AS visit, "
        "                  count(*) AS children, min(id::text) AS id "
        "           FROM stepstone.instances WHERE parent_id IS NOT NULL GROUP BY 1, 2, 3) "
        "SELECT instance_id, pos, visit, s.started, c.children, s.child_id, c.id "
        "FROM s FULL JOIN c USING (instance_id, pos, visit) "
        "WHERE s.started IS DISTINCT FROM 1 OR c.children IS DISTINCT FROM 1 OR s.child_id IS DISTINCT FROM c.id "
        "UNION ALL "
        "SELECT p.id, NULL, NULL, NULL, count(c.*), NULL, NULL FROM stepstone.instances p "
        "LEFT JOIN stepstone.instances c ON c.parent_id = p.id "
        "WHERE p.definition_id = $1 GROUP BY p.id HAVING count(c.*) <> 1", workflows.PARENT.id)
    if children:
        bad("child_twice", f"{len(children)} child-step visits or parents, e.g. {[dict(r) for r in children[:5]]}")
    resumed = await conn.fetch(
        "SELECT p.id, p.status, p.state, (SELECT count(*) FROM stepstone.history h "
        "                                 WHERE h.instance_id = p.id AND h.kind = 'CHILD_COMPLETED') AS resumed, "
        "       (SELECT min(c.id::text) FROM stepstone.instances c WHERE c.parent_id = p.id) AS child "
        "FROM stepstone.instances p WHERE p.id IN (SELECT parent_id FROM stepstone.instances) "
        "   OR p.definition_id = $1", workflows.PARENT.id)
    wrong = [dict(r) for r in resumed
             if r["resumed"] != 1 or (r["status"] == "COMPLETED" and _child_seen(r["state"]) != r["child"])]
    if wrong:
        bad("parent_resumed", f"{len(wrong)} parents, e.g. {wrong[:5]}")
    open_positions = await conn.fetch(
        "SELECT i.id, i.branches, count(p.*) AS open FROM stepstone.instances i "
        "LEFT JOIN stepstone.positions p ON p.instance_id = i.id AND p.status NOT IN ('COMPLETED', 'CANCELLED') "
        "WHERE i.status = 'COMPLETED' GROUP BY i.id, i.branches HAVING count(p.*) > 0 OR i.branches <> 0")
    if open_positions:
        bad("open_position", f"{len(open_positions)} instances, e.g. {[dict(r) for r in open_positions[:5]]}")


async def _tasks_and_messages(conn: asyncpg.Connection, bad: Any) -> None:
    """Each task instance's one task completed once, and its one message delivered once, to it."""
    tasks = await conn.fetch(
        "SELECT i.id, (SELECT count(*) FROM stepstone.tasks t WHERE t.instance_id = i.id) AS tasks, "
        "       (SELECT count(*) FROM stepstone.tasks t "
        "          WHERE t.instance_id = i.id AND t.status = 'COMPLETED') AS done, "
        "       (SELECT count(*) FROM stepstone.history h WHERE h.instance_id = i.id "
        "          AND h.kind = 'TASK_COMPLETED') AS completions "
        "FROM stepstone.instances i WHERE i.definition_id = $1", workflows.TASK.id)
    wrong = [dict(r) for r in tasks if (r["tasks"], r["done"], r["completions"]) != (1, 1, 1)]
    left_open = await conn.fetchval("SELECT count(*) FROM stepstone.tasks WHERE status IN ('OPEN', 'COMPLETING')")
    if wrong or left_open:
        bad("task_once", f"{len(wrong)} task instances, {left_open} tasks left open; e.g. {wrong[:5]}")
    messages = await conn.fetch(
        "SELECT i.id, i.state->>'key' AS key, i.state->>'got' AS got, i.status, "
        "       (SELECT count(*) FROM stepstone.history h WHERE h.instance_id = i.id "
        "          AND h.kind = 'MESSAGE_CORRELATED') AS correlated "
        "FROM stepstone.instances i WHERE i.definition_id = $1", workflows.TASK.id)
    wrong = [dict(r) for r in messages
             if r["correlated"] != 1 or (r["status"] == "COMPLETED" and r["got"] != r["key"])]
    delivered_twice = await conn.fetchval(
        "SELECT count(*) FROM stepstone.messages WHERE jsonb_array_length(deliveries) > 1")
    if wrong or delivered_twice:
        bad("message_once", f"{len(wrong)} task instances, {delivered_twice} messages delivered twice; "
                            f"e.g. {wrong[:5]}")


def _child_seen(state: Any) -> Any:
    doc = json.loads(state) if isinstance(state, str) else state
    return doc.get("child_id") if isinstance(doc, dict) else None
