"""Reading history: entries with their actor and outcome, and the state at any point of it.

The state at a point is the last baseline before it (the start, a replay, an oversized change)
plus every patch after it, in commit order: the instance row is locked by every commit, so history
order is commit order, and the patches of concurrent branches touch disjoint parts of the state
(the commit refuses the rest as conflicts).
"""

from __future__ import annotations

import copy
from typing import Any

from stepstone.core.attribution import Actor
from stepstone.core.model import FAILURE_KINDS
from stepstone.core.redaction import REDACTED, Path
from stepstone.core.saga import SAGA
from stepstone.errors import InvalidInput
from stepstone.ops.model import HistoryEntry

__all__ = [
    "BASELINE_KINDS",
    "FAILURE_KINDS",
    "compensated_since",
    "compensations_shown",
    "entry",
    "migrated_since",
    "outcome_of",
    "replay_from",
    "replay_point",
    "replay_start",
    "state_at",
]

BASELINE_KINDS = frozenset({"INSTANCE_STARTED", "STATE_BASELINE", "INSTANCE_REPLAYED", "INSTANCE_MIGRATED"})

_OUTCOMES = {
    "INSTANCE_STARTED": "started",
    "STEP_COMPLETED": "completed",
    "STATE_BASELINE": "baseline",
    "WAITING": "waiting",
    "SIGNAL_APPLIED": "applied",
    "SIGNAL_PARKED": "parked",
    "TIMER_FIRED": "fired",
    "WAIT_TIMED_OUT": "timed out",
    "FORK_STARTED": "forked",
    "BRANCH_COMPLETED": "completed",
    "BRANCH_JOINED": "joined",
    "BRANCH_PARKED": "parked",
    "BRANCH_FAILED": "failed, passed over",
    "JOINED": "joined",
    "CHILD_STARTED": "started child",
    "CHILD_COMPLETED": "completed",
    "CHILD_FAILED": "failed",
    "CALLBACK_IGNORED": "ignored",
    "COMMAND_DEAD_LETTERED": "dead-lettered",
    "INSTANCE_FAILED": "failed",
    "INSTANCE_COMPLETED": "completed",
    "INSTANCE_CANCELLED": "cancelled",
    "INSTANCE_RETRIED": "retried",
    "INSTANCE_REPLAYED": "replayed",
}


def outcome_of(kind: str, data: Any) -> str:
    """What came of the decision an entry records, in a word or two."""
    if kind == "STEP_FAILED":
        return "retrying" if isinstance(data, dict) and "retry_in" in data else "failed"
    return _OUTCOMES.get(kind, kind.lower().replace("_", " "))


def entry(row: dict[str, Any]) -> HistoryEntry:
    data = row["data"]
    patch = data.get("patch") if isinstance(data, dict) and isinstance(data.get("patch"), list) else None
    return HistoryEntry(
        seq=row["seq"], at=row["at"], kind=row["kind"], position=row["position"] or "", step=row["step"],
        visit=row["visit"], command_id=row["command_id"], command_kind=row.get("command_kind"),
        actor=Actor.parse(row["actor"]), outcome=outcome_of(row["kind"], data), patch=patch, data=data,
    )


def _apply(doc: Any, ops: list[Any]) -> Any:
    """Apply an RFC 6902 patch of add/remove/replace operations; a path that is gone is skipped."""
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in str(op.get("path", "")).split("/")[1:]]
        if not parts:
            doc = copy.deepcopy(op.get("value"))
            continue
        parent = doc
        for p in parts[:-1]:
            parent = parent.get(p) if isinstance(parent, dict) else None
        if not isinstance(parent, dict):
            continue
        if op.get("op") == "remove":
            parent.pop(parts[-1], None)
        else:
            parent[parts[-1]] = copy.deepcopy(op.get("value"))
    return doc


def state_at(history: list[HistoryEntry], before_seq: int) -> Any:
    """The state as it was just before entry `before_seq`: the last baseline before it, patched on."""
    base = None
    for e in history:
        if e.seq < before_seq and e.kind in BASELINE_KINDS and isinstance(e.data, dict) and "state" in e.data:
            base = e
    if base is None:
        raise InvalidInput("the history holds no baseline of the state before that point", what="history")
    state = copy.deepcopy(base.data["state"])
    for e in history:
        if base.seq < e.seq < before_seq and e.patch:
            state = _apply(state, e.patch)
    return state


def replay_start(history: list[HistoryEntry], step: str) -> str:
    """The root step a replay from `step` starts at: `step` itself when it ran at the root; for a step
    that ran inside a branch, the root fork that opened the branch (its latest run), because branches
    share the state and the join waits for all of them: the whole fork runs again."""
    if any(e.position == "" and e.step == step for e in history):
        return step
    in_branch = [e for e in history if e.position and e.step == step]
    if not in_branch:
        return step  # replay_point says what ran instead
    return max(in_branch, key=lambda e: e.seq).position.split("/")[0]


def replay_point(history: list[HistoryEntry], step: str) -> HistoryEntry:
    """The first entry of the latest visit of `step` at the root position: replay starts there."""
    visits = [e for e in history if e.position == "" and e.step == step and e.visit is not None
              and e.kind not in ("INSTANCE_STARTED", "INSTANCE_REPLAYED", "INSTANCE_RETRIED", "INSTANCE_CANCELLED")]
    if not visits:
        ran = sorted({e.step for e in history if e.position == "" and e.step})
        raise InvalidInput(f"step {step!r} never ran in this instance"
                           + (f"; it ran: {', '.join(ran)}" if ran else ""), what="step")
    latest = max(e.visit or 0 for e in visits)
    return min((e for e in visits if e.visit == latest), key=lambda e: e.seq)


def migrated_since(history: list[HistoryEntry], point: HistoryEntry) -> HistoryEntry | None:
    """The latest migration (its INSTANCE_MIGRATED entry) at or after `point`, unless `point`'s visit was the
    root's when it migrated. Before a migration the state and the steps were the old version's, which the
    new one may not take; a visit that went on across it starts again from the migration (`replay_from`)."""
    migrated = _last_migration(history)
    if migrated is None or point.seq > migrated.seq or (migrated.step, migrated.visit) == (point.step, point.visit):
        return None
    return migrated


def replay_from(history: list[HistoryEntry], point: HistoryEntry) -> tuple[HistoryEntry, Any]:
    """The entry a replay from `point` starts at and the state it starts from: the state just before it, or,
    for a visit that went on across the latest migration, that migration's entry and the state it set."""
    migrated = _last_migration(history)
    if migrated is not None and point.seq <= migrated.seq:
        return migrated, state_at(history, migrated.seq + 1)
    return point, state_at(history, point.seq)


def _last_migration(history: list[HistoryEntry]) -> HistoryEntry | None:
    return next((e for e in reversed(history) if e.kind == "INSTANCE_MIGRATED"), None)


def compensated_since(history: list[HistoryEntry], point: HistoryEntry) -> str | None:
    """The first step whose latest run before `point` a saga has compensated since, if any: a replay from
    `point` starts from a state that holds what that run did, which is undone (docs/sagas.md)."""
    undone = {(e.step, e.visit) for e in history if e.kind == "STEP_COMPENSATED"}
    latest: dict[tuple[str, str], HistoryEntry] = {}  # (position, step) -> the first entry of its latest visit
    for e in history:
        if e.seq >= point.seq or not e.step or e.visit is None or e.position == SAGA:
            continue
        if (e.position, e.step, e.visit) == (point.position, point.step, point.visit):
            continue  # the run replayed itself (its INSTANCE_STARTED, say)
        seen = latest.get((e.position, e.step))
        if seen is None or (seen.visit or 0) < e.visit:
            latest[(e.position, e.step)] = e
    hits = [e for e in latest.values() if (e.step, e.visit) in undone]
    return min(hits, key=lambda e: e.seq).step if hits else None


def restore_sensitive(state: Any, live: Any, paths: tuple[Path, ...]) -> Any:
    """Put the live state's values back where history holds `[redacted]` (history never had them)."""
    for path in paths:
        state = _restore(state, live, path)
    return state


def _restore(state: Any, live: Any, path: Path) -> Any:
    if not path:
        return copy.deepcopy(live) if state == REDACTED else state
    head, rest = path[0], path[1:]
    if head == "*":
        if isinstance(state, list) and isinstance(live, list):
            return [_restore(s, live[n] if n < len(live) else None, rest) for n, s in enumerate(state)]
        return state
    if isinstance(state, dict) and head in state:
        inner = live.get(head) if isinstance(live, dict) else None
        return {**state, head: _restore(state[head], inner, rest)}
    return state


def compensations_shown(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An instance's compensations as the operator's views show them (`stepstone show`, the API, the UI):
    step, position, visit, status, attempts, last error, when the step completed and when it was undone,
    in order of completion. Without what the step recorded: that is its compensation's input, kept whole
    for it as the live state is, and it may hold values the state marks sensitive (`client.compensations`
    gives it to Python)."""
    return [{k: v for k, v in row.items() if k != "recorded"} for row in rows]
