"""Retention: archive instances past their policy's window, purge archived ones, drop old published
outbox rows, in bounded batches that never wait for a row a worker holds.

Policies are data (`retention_policies`, per workflow with a '*' default, seeded with 30 days for
completed, 180 days for failed, never for waiting, 7 days for published outbox rows). One sweep
runs at a time (an advisory lock): `run` returns a report with `ran=False` when another holds it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from stepstone._waiting import cancel_and_wait
from stepstone.errors import InvalidInput
from stepstone.ops.model import RetentionReport
from stepstone.store.operations_port import OperationsStore

__all__ = ["MIN_INTERVAL", "OUTBOX_PUBLISHED", "STATUS_CLASSES", "RetentionLoop", "check_policy", "policies", "run",
           "set_policy"]

log = logging.getLogger("stepstone.retention")

OUTBOX_PUBLISHED = "outbox_published"
STATUS_CLASSES = ("completed", "failed", "waiting", OUTBOX_PUBLISHED)
Progress = Callable[[str, RetentionReport], None]


async def policies(store: OperationsStore) -> list[dict[str, Any]]:
    """Every policy row: workflow ('*' = the default), status class, retain_for, purge_after."""
    return await store.retention_policies()


async def set_policy(
    store: OperationsStore, workflow: str, status_class: str, retain_for: timedelta | None,
    purge_after: timedelta | None = None,
) -> dict[str, Any]:
    """Set one window (None = never on a timer) for a workflow or the '*' default."""
    check_policy(workflow, status_class, purge_after)
    return await store.set_retention_policy(workflow, status_class, retain_for, purge_after)


def check_policy(workflow: str, status_class: str, purge_after: timedelta | None) -> None:
    """Published outbox rows are dropped for every workflow at once, by the '*' window alone, in one
    stage: a per-workflow window or a purge window for them would be stored and never applied."""
    if status_class != OUTBOX_PUBLISHED:
        return
    if workflow != "*":
        raise InvalidInput(f"{OUTBOX_PUBLISHED} takes only the '*' workflow: published outbox rows are dropped "
                           "for every workflow at once", what="workflow")
    if purge_after is not None:
        raise InvalidInput("published outbox rows have no purge window: they are dropped once past their "
                           "window, not archived first", what="purge_after")


async def run(
    store: OperationsStore, *, dry_run: bool = False, batch_size: int = 500, progress: Progress | None = None,
    workflow: str | None = None, scope: str | None = None,
) -> RetentionReport:
    """One sweep: archive, then purge, then old published outbox rows and expired buffered messages; each
    batch its own transaction. `workflow` and `scope` narrow the instances swept (not the outbox rows
    nor the messages, which belong to no one instance filter)."""
    report = RetentionReport(dry_run=dry_run)
    started = time.perf_counter()
    holder = await store.try_retention_lock()
    if holder is None:
        report.ran = False
        return report
    try:
        for phase in ("archive", "purge"):
            after: str | None = None
            while True:
                batch = await store.retention_batch(phase, batch_size, after, dry_run, workflow, scope)
                if not batch["scanned"]:
                    break
                report.batches += 1
                if phase == "archive":
                    report.archived += batch["done"]
                else:
                    report.purged += batch["done"]
                    report.held_unsent += batch["unsent"]
                    report.held_dead += batch["dead"]
                report.skipped_busy += batch["busy"]
                report.skipped_active += batch["active"]
                after = batch["last_id"]
                if progress is not None:
                    progress(phase, report)
        await _in_batches(store.retention_outbox, "outbox_purged", report, dry_run, batch_size, progress)
        # Expiring a buffered message drops its payload (migration 0020).
        await _in_batches(store.retention_messages, "messages_expired", report, dry_run, batch_size, progress)
    finally:
        await store.release_retention_lock(holder)
    report.seconds = time.perf_counter() - started
    return report


async def _in_batches(
    step: Callable[[int, bool], Awaitable[int]], field: str, report: RetentionReport, dry_run: bool,
    batch_size: int, progress: Progress | None,
) -> None:
    """Rows past their window, batch by batch (counted at once in a dry run), added to `report.<field>`:
    published outbox rows, buffered messages past their TTL."""
    if dry_run:
        setattr(report, field, await step(2**31 - 1, True))
        return
    while True:
        n = await step(batch_size, False)
        setattr(report, field, getattr(report, field) + n)
        report.batches += 1
        if progress is not None:
            progress(field, report)
        if n < batch_size:
            return


MIN_INTERVAL = 1.0
"""Seconds between a retention loop's sweeps at the least: at 0 it swept in a busy loop."""


class RetentionLoop:
    """Retention every `interval` seconds (at least MIN_INTERVAL) beside a worker (opt-in). Every replica
    may run one: the advisory lock lets one sweep at a time through, the others skip that round."""

    def __init__(self, store: OperationsStore, interval: float, *, batch_size: int = 500) -> None:
        if not interval >= MIN_INTERVAL:  # NaN too
            raise InvalidInput(f"retention runs at least {MIN_INTERVAL:g} s apart, got {interval} s", what="interval")
        self.store = store
        self.interval = interval
        self.batch_size = batch_size
        self.runs = 0
        self.last: RetentionReport | None = None
        self._task: asyncio.Task[None] | None = None
        self.swept = asyncio.Event()
        """Set after each round (test signal)."""

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="stepstone-retention")

    async def stop(self) -> None:
        if self._task is not None:
            # A cancellation of the caller while the loop ends is raised (the loop's own is not).
            await cancel_and_wait(self._task)
            self._task = None

    async def _loop(self) -> None:
        while True:
            try:
                self.last = await run(self.store, batch_size=self.batch_size)
                self.runs += 1
                if self.last.ran:
                    _log_round(self.last)
            except Exception as exc:  # noqa: BLE001 - a failed round is retried next round
                log.warning("retention round failed (%s: %s)", type(exc).__name__, exc)
            self.swept.set()
            await asyncio.sleep(self.interval)


def _log_round(report: RetentionReport) -> None:
    """What a loop's round did, at INFO, naming only the counts that are not 0 (with what it left, if it
    did anything); a round that did nothing says so at DEBUG only: a sweep every minute logged a line of
    zeros every minute."""
    def said(counts: tuple[tuple[int, str], ...]) -> str:
        return ", ".join(f"{n} {what}" for n, what in counts if n)

    done = said(((report.archived, "archived"), (report.purged, "purged"),
                 (report.outbox_purged, "published outbox row(s) dropped"),
                 (report.messages_expired, "buffered message(s) expired")))
    left = said(((report.held_unsent, "held back (unsent event)"),
                 (report.held_dead, "held back (dead-lettered event)"),
                 (report.skipped_busy, "skipped (busy)"), (report.skipped_active, "skipped (active)")))
    if done:
        log.info("retention: %s%s", done, f"; {left}" if left else "")
    else:
        log.debug("retention: nothing to sweep%s", f" ({left})" if left else "")
