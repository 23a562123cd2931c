"""Reading instances: filtered pages and counts, the detail of one, history pages, the execution
probe and the stuck report. Sensitive values are shown as `[redacted]`."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from stepstone.core.limits import MAX_INT4
from stepstone.core.redaction import Path, Redaction, redact_state
from stepstone.ops.history import entry
from stepstone.ops.model import (
    HistoryPage,
    InstanceDetail,
    InstancePage,
    InstanceSummary,
    ProbeReport,
    Retrying,
    StuckItem,
    StuckReport,
)
from stepstone.store.operations_port import InstanceFilter, OperationsStore

__all__ = ["count", "detail", "find", "history_page", "probe", "sensitive_paths_of", "stuck"]

MAX_PAGE = 1000
MAX_REPORT = 1000


def _summary(r: dict[str, Any]) -> InstanceSummary:
    return InstanceSummary(
        id=r["id"], scope=r["scope"], workflow=r["definition_id"], version=r["version"], status=r["status"],
        step=r["step"], business_key=r["business_key"], parent_id=r["parent_id"], created_at=r["created_at"],
        updated_at=r["updated_at"], ended_at=r["ended_at"], archived_at=r["archived_at"],
    )


async def find(
    store: OperationsStore, where: InstanceFilter, *, after: tuple[datetime, str] | None = None, limit: int = 50
) -> InstancePage:
    """Instances matching `where`, newest first; `next_after` continues (keyset pagination)."""
    limit = max(1, min(limit, MAX_PAGE))
    rows = await store.find_instances(where, after, limit + 1)
    items = [_summary(r) for r in rows[:limit]]
    more = len(rows) > limit
    return InstancePage(items, (items[-1].created_at, items[-1].id) if more and items else None)


async def count(store: OperationsStore, where: InstanceFilter) -> dict[str, int]:
    """How many instances match `where`, by status."""
    return await store.count_instances(where)


def sensitive_paths_of(extra: dict[str, Any]) -> tuple[Path, ...]:
    paths = extra.get("sensitive") or []
    return tuple(tuple(str(p) for p in path) for path in paths if isinstance(path, list))


async def detail(store: OperationsStore, instance_id: str, *, reveal: bool = False) -> InstanceDetail:
    """One instance: state (redacted unless `reveal`), positions, open commands, timers, children,
    outbox events and any step waiting out a retry backoff."""
    row = await store.instance(instance_id)
    extra = await store.instance_extra(instance_id)
    commands = await store.instance_commands(instance_id)
    outbox = await store.instance_outbox(instance_id)
    retrying = await store.retrying(instance_id)
    paths = sensitive_paths_of(extra)
    max_attempts = extra.get("max_attempts") or {}
    state = row["state"] if reveal else redact_state(row["state"], paths)
    positions = row["positions"] if reveal else Redaction(paths).shown_waits(row["state"], None, row["positions"])[1]
    return InstanceDetail(
        id=row["id"], scope=extra["scope"], workflow=row["definition_id"], version=row["version"],
        status=row["status"], step=row["step"], business_key=row["business_key"],
        parent_id=None if row["parent_id"] is None else str(row["parent_id"]), state=state, error=row["error"],
        created_at=row["created_at"], updated_at=row["updated_at"], ended_at=row["ended_at"],
        archived_at=extra["archived_at"], positions=positions,
        commands=[c for c in commands if c["kind"] != "TIMER"],
        timers=[c for c in commands if c["kind"] == "TIMER"],
        children=row["children"], outbox=outbox,
        retrying=[Retrying(r["position"], r["step"], r["attempt"], max_attempts.get(r["step"] or ""),
                           r["available_at"], r["last_error"]) for r in retrying],
    )


async def history_page(
    store: OperationsStore, instance_id: str, *, after: int = 0, limit: int = 100, failed_only: bool = False
) -> HistoryPage:
    """History entries after `after` (a seq), oldest first; only failures when `failed_only`."""
    await store.instance_extra(instance_id)  # InstanceNotFound for an unknown id
    limit = max(1, min(limit, MAX_PAGE))
    after = max(0, min(after, MAX_INT4))  # a seq is an int4: past its largest, nothing follows
    rows = await store.history_page(instance_id, after, limit + 1, failed_only)
    entries = [entry(r) for r in rows[:limit]]
    return HistoryPage(entries, entries[-1].seq if len(rows) > limit and entries else None)


async def probe(store: OperationsStore, instance_id: str | None = None,
                where: InstanceFilter | None = None) -> ProbeReport:
    """The execution probe: idle when nothing is in flight and nothing could be claimed now (of one
    instance, of the instances `where` keeps, or of all)."""
    if instance_id is not None:
        await store.instance_extra(instance_id)
    # What is busy comes from its own read: the listing is capped, and the pending timers and parked
    # signals of a thousand waiting instances would fill it before a claimable command of a newer one.
    busy = await store.busy_commands(instance_id, MAX_REPORT + 1, where)
    rows = await store.open_commands(instance_id, MAX_REPORT + 1, where)
    more = len(busy) > MAX_REPORT or len(rows) > MAX_REPORT  # one row past the cap: the lists are cut
    busy, rows = busy[:MAX_REPORT], rows[:MAX_REPORT]
    in_flight = [r for r in busy if r["in_flight"]]
    claimable = [r for r in busy if r["claimable"]]
    rest = [r for r in rows if not r["in_flight"] and not r["claimable"]]
    return ProbeReport(
        instance_id=instance_id, idle=not in_flight and not claimable, in_flight=in_flight, claimable=claimable,
        deferred=[r for r in rest if r["state"] == "DEFERRED"], parked=[r for r in rest if r["state"] == "PARKED"],
        waiting=[r for r in rest if r["state"] in ("PENDING", "CLAIMED")], more=more,
    )


async def stuck(store: OperationsStore, older_than: timedelta = timedelta(minutes=15),
                where: InstanceFilter | None = None) -> StuckReport:
    """Commands open for longer than `older_than`, every dead letter, every step retrying (of the
    instances `where` keeps, or of all)."""
    found = await store.stuck(older_than, MAX_REPORT + 1, where)
    rows = found[:MAX_REPORT]
    return StuckReport(older_than.total_seconds(), more=len(found) > MAX_REPORT, items=[
        StuckItem(
            command_id=r["id"], instance_id=r["instance_id"], workflow=r["definition_id"],
            instance_status=r["instance_status"], position=r["position"], kind=r["kind"], state=r["state"],
            step=r["step"], attempt=r["attempt"], reason=r["reason"],
            since=r["available_at"] if r["kind"] == "TIMER" else r["created_at"], available_at=r["available_at"],
            last_error=r["last_error"],
        ) for r in rows
    ])
