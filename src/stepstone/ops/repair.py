"""Repair: retry or cancel one instance, a selection or every instance matching a filter (with a dry
run and a result per instance), and replay an instance from a step of its history."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any

from stepstone.core.messages import signal_cause
from stepstone.core.redaction import redact_state
from stepstone.errors import (
    InstanceNotFound,
    InvalidInput,
    InvalidState,
    child_not_awaited,
    child_report_pending,
    parent_went_on,
)
from stepstone.ops.history import (
    compensated_since,
    entry,
    migrated_since,
    replay_from,
    replay_point,
    replay_start,
    restore_sensitive,
)
from stepstone.ops.model import BulkItem, BulkReport, HistoryEntry, ReplayResult
from stepstone.ops.queries import sensitive_paths_of
from stepstone.store.operations_port import InstanceFilter, OperationsStore

__all__ = ["cancel", "matching_ids", "replay", "retry", "saga_unchanged"]

Progress = Callable[[int, int], None]
"""progress(done, total) after each batch."""

_PAGE = 1000


async def matching_ids(store: OperationsStore, where: InstanceFilter) -> list[str]:
    """Every instance id `where` matches, newest first (read in keyset pages)."""
    ids: list[str] = []
    after: tuple[datetime, str] | None = None
    while True:
        rows = await store.find_instances(where, after, _PAGE)
        ids.extend(r["id"] for r in rows)
        if len(rows) < _PAGE:
            return ids
        after = (rows[-1]["created_at"], rows[-1]["id"])


async def _bulk(
    action: str, store: OperationsStore, ids: Sequence[str] | None, where: InstanceFilter | None, *,
    dry_run: bool, batch_size: int, progress: Progress | None,
    apply: Callable[[list[str]], Awaitable[list[dict[str, Any]]]],
) -> BulkReport:
    if (ids is None) == (where is None):
        raise InvalidInput("give instance ids or a filter (not both)", what="selection")
    targets = list(dict.fromkeys(ids)) if ids is not None else await matching_ids(store, where or InstanceFilter())
    report = BulkReport(action, dry_run, matched=len(targets))
    if dry_run:
        return report
    for start in range(0, len(targets), batch_size):
        chunk = targets[start:start + batch_size]
        rows = await apply(chunk)
        for r in rows:
            ok = r["outcome"] in ("retried", "cancelled", "compensating")
            reason = None if ok else _why(action, r)
            report.items.append(BulkItem(r["id"], ok, r["outcome"], r["status"], reason))
            report.succeeded += ok
            report.failed += not ok
        if progress is not None:
            progress(min(start + batch_size, len(targets)), len(targets))
    return report


def _why(action: str, row: dict[str, Any]) -> str:
    outcome, status = row["outcome"], row["status"]
    refused = _child_refused(row)
    if refused is not None:
        return refused
    if outcome == "not_found":
        return "no such instance"
    if outcome == "not_failed":
        return f"it is {status}; only a FAILED or COMPENSATION_FAILED instance can be retried"
    if outcome == "unchanged":
        return saga_unchanged(status) or f"it had already ended ({status})"
    return f"{action}: {outcome}"


def _child_refused(row: dict[str, Any]) -> str | None:
    """Why a retry of a child was refused for its parent's sake, or None for any other outcome."""
    outcome, child = row["outcome"], str(row["id"])
    if outcome == "parent_went_on":
        return str(parent_went_on(child, str(row["parent_id"]), row["parent_status"] or "deleted"))
    if outcome == "not_awaited":
        return str(child_not_awaited(child, row.get("parent") or {}))
    if outcome == "report_pending":
        return str(child_report_pending(child, str(row["parent_id"]), row["parent_status"]))
    return None


_SAGA_UNCHANGED = {
    "COMPENSATING": "already compensating; nothing changed (`stepstone cancel` without --compensate stops it)",
    "COMPENSATION_FAILED": "its compensation stopped; nothing changed (`stepstone retry` resumes it, "
                           "`stepstone cancel` without --compensate gives up)",
}


def saga_unchanged(status: str) -> str | None:
    """Why a cancel asked to compensate left a saga that has not ended as it is (it compensates already, or
    its compensation stopped), and what to do instead; None for any other status (an instance that ended)."""
    return _SAGA_UNCHANGED.get(status)


async def retry(
    store: OperationsStore, *, ids: Sequence[str] | None = None, where: InstanceFilter | None = None,
    dry_run: bool = False, actor: str | None = None, batch_size: int = 500, progress: Progress | None = None,
) -> BulkReport:
    """Retry the failed step of each instance (ids, or every one `where` matches); one result each."""
    return await _bulk("retry", store, ids, where, dry_run=dry_run, batch_size=batch_size, progress=progress,
                       apply=lambda chunk: store.retry_many(chunk, actor))


async def cancel(
    store: OperationsStore, *, ids: Sequence[str] | None = None, where: InstanceFilter | None = None,
    reason: str = "", dry_run: bool = False, actor: str | None = None, batch_size: int = 500,
    progress: Progress | None = None, compensate: bool = False,
) -> BulkReport:
    """Cancel each instance (ids, or every one `where` matches), compensating its completed steps first
    with `compensate` (outcome `compensating`), as a single cancel does; one result each."""
    return await _bulk("cancel", store, ids, where, dry_run=dry_run, batch_size=batch_size, progress=progress,
                       apply=lambda chunk: store.cancel_many(chunk, reason, actor, compensate))


_LED_BY = {"SIGNAL_APPLIED": "SIGNAL", "MESSAGE_CORRELATED": "MESSAGE"}


async def _cause(store: OperationsStore, instance_id: str, history: list[HistoryEntry], point: HistoryEntry) -> Any:
    """What led to the step at the replay point, given to its handler again as a retry's is: the signal or
    message applied just before it (ctx.signal; its payload as its command keeps it, so redacted where the
    payload model marks a field sensitive), else None."""
    before = [e for e in history if e.seq < point.seq and e.position == ""]
    led = before[-1] if before else None
    if led is None or led.kind not in _LED_BY or not isinstance(led.data, dict):
        return None
    command = await store.command_of(instance_id, int(led.data["command"]))
    if command is None or command["kind"] != _LED_BY[led.kind]:
        return None
    return signal_cause(command["kind"], str(command["name"]), command["payload"])


async def replay(store: OperationsStore, instance_id: str, step: str, *, actor: str | None = None) -> ReplayResult:
    """Run `step` again with the state the instance had when it last reached it (the latest visit at the
    root position), as a new attempt; everything since stays in history. A step that ran inside a
    branch replays its root fork: every branch runs again (`ReplayResult.from_step` says which step).
    Sensitive values, which history never held, come from the live state. Children: a child step
    run again starts a new child (its id comes from the new visit) and the old child is left as it
    ended; a replayed child reports to its parent only if the parent still waits for it (otherwise
    the parent records the report as CALLBACK_IGNORED and does not move). Refused (InvalidState)
    when a step that ran before it was compensated since: the instance would go on with that step
    undone; the message names the step to replay from."""
    rows = await store.full_history(instance_id)
    if not rows:
        raise InstanceNotFound(instance_id)
    history = [entry(r) for r in rows]
    requested, step = step, replay_start(history, step)
    point = replay_point(history, step)
    extra = await store.instance_extra(instance_id)
    paths = sensitive_paths_of(extra)
    row = await store.instance(instance_id)
    if not extra["plan_stored"]:  # another plan's paths would restore (or leave out) the wrong values
        stored = extra["stored_plan_hash"]
        found = f"v{extra['version']} is stored with plan {stored[:12]}" if stored else f"no v{extra['version']} is"
        raise InvalidState(
            f"instance {instance_id} runs {extra['definition_id']!r} v{extra['version']} with plan "
            f"{extra['plan_hash'][:12]}, which is not stored ({found}): its sensitive paths are unknown; register "
            "that plan's code to replay it; nothing was changed", instance_id=instance_id, status=row["status"])
    migrated = migrated_since(history, point)
    if migrated is not None:
        since = list(dict.fromkeys(e.step for e in history if e.seq >= migrated.seq and e.position == "" and e.step))
        data = migrated.data if isinstance(migrated.data, dict) else {}
        raise InvalidState(
            f"step {step!r} last ran before the instance migrated from v{data.get('from_version')} to "
            f"v{data.get('to_version')} (history entry {migrated.seq}): its state then was the old version's, and "
            f"the step may not be the new one's; replay from a step run since ({', '.join(since)})",
            instance_id=instance_id, status=row["status"])
    point, state = replay_from(history, point)
    undone = compensated_since(history, point)
    if undone is not None:
        raise InvalidState(
            f"step {undone!r} ran before {step!r} and was compensated (undone) since: a replay from {step!r} "
            f"would go on as if it had not been; replay from {undone!r} or an earlier step, which runs it again",
            instance_id=instance_id, status=row["status"])
    live = row["state"]
    state = restore_sensitive(state, live, paths)
    baseline = redact_state(state, paths)
    cause = await _cause(store, instance_id, history, point)
    row = await store.replay(instance_id, step, state, baseline, history[-1].seq, point.seq, actor, cause)
    if row["outcome"] == "not_found":
        raise InstanceNotFound(instance_id)
    if row["outcome"] == "active":
        raise InvalidState(f"instance {instance_id} is {row['status']}; cancel it (or let it fail) before a replay",
                           instance_id=instance_id, status=row["status"])
    if row["outcome"] == "child_live":
        raise _child_live(instance_id, row["status"], row.get("children") or [])
    if row["outcome"] == "changed":
        raise InvalidState(f"instance {instance_id} changed while the replay was prepared; try again",
                           instance_id=instance_id, status=row["status"])
    return ReplayResult(instance_id, step, point.seq, row["visit"], row["status"], baseline, requested)


def _child_live(instance_id: str, status: str, children: list[dict[str, Any]]) -> InvalidState:
    """The refusal of a replay of a parent that awaits a child still under way (a retried one, or a branch's
    while another branch failed): the replay would leave it running for a result nothing takes, beside
    the new child its step starts when it runs again."""
    named = ", ".join(f"{c['id']} ({c['definition_id']}, {c['status']}"
                      + (f", in branch {c['parent_position']})" if c.get("parent_position") else ")")
                      for c in children) or "a child"
    first = children[0]["id"] if children else "CHILD"
    return InvalidState(
        f"instance {instance_id} is not replayed: it still awaits its child {named}, which has not ended; a replay "
        "would leave that child running for a result nothing takes, and its steps would run again in the child "
        f"the replayed step starts. Nothing changed. Wait for the child to end, then retry {instance_id} (it "
        f"goes on with the child's result), or cancel the child first (stepstone cancel {first}) and replay again",
        instance_id=instance_id, status=status)
