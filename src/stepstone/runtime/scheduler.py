"""The schedule firer: every worker runs one; whichever gets a due schedule's row starts its ticks.

    fire_due()   read the due schedules of the workflows this node has, compute each one's ticks
                 (catch-up policy, `scheduling.schedule.due_ticks`) and fire each in one statement
                 that locks its row with SKIP LOCKED and advances it (exactly one start per tick)
    run()        fire_due, then sleep until the next tick or `interval`, whichever is first

`Worker.run_until_idle` fires first, so a test that moves the clock fires schedules by running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stepstone.authoring.workflow import Registry
from stepstone.scheduling.schedule import ScheduleSpec, due_ticks, tick_instance_id
from stepstone.store.scheduling_port import SchedulingStore

log = logging.getLogger("stepstone.scheduler")

__all__ = ["ScheduleFirer"]

_BATCH = 16


@dataclass
class FiringCounts:
    started: int = 0
    skipped: int = 0
    busy: int = 0


class ScheduleFirer:
    """Fires the due schedules of the workflows in `registry`."""

    def __init__(self, store: SchedulingStore, registry: Registry) -> None:
        self.store = store
        self.registry = registry
        self.counts = FiringCounts()

    @property
    def names(self) -> list[str]:
        """The workflows whose schedules this node fires."""
        return sorted({wf.id for wf in self.registry})

    async def next_tick(self) -> float | None:
        """Seconds to the next tick this node can fire, or None. A schedule of a workflow it does not
        have is not its to wait for: counted, one overdue for a node that never comes turned every
        other node's loop into a poll every 10 ms."""
        names = self.names
        return await self.store.next_schedule(names) if names else None

    async def fire_due(self) -> int:
        """Fire every due schedule this node can start; returns how many instances it started."""
        started = 0
        names = self.names
        if not names:
            return 0
        while True:
            progressed = False
            for row in await self.store.due_schedules(_BATCH, names):
                outcome = await self._fire(row)
                started += max(outcome, 0)
                progressed = progressed or outcome >= 0
            if not progressed:
                return started

    async def _fire(self, row: dict[str, Any]) -> int:
        """Fire one schedule; returns instances started, or -1 when another worker had or moved it."""
        name = str(row["name"])
        wf = self.registry.latest(str(row["definition_id"]))
        assert wf is not None  # due_schedules only returns the registry's workflows
        spec = ScheduleSpec.from_document(row["spec"])
        first, now = row["next_fire_at"], row["now"]
        ticks, following = due_ticks(spec, first, now)
        try:
            state = wf.state_to_json({} if row["input"] is None else row["input"], what="schedule input")
        except Exception as exc:  # noqa: BLE001 - a bad stored input must not stop the other schedules
            log.error(  # noqa: TRY400 - one line: the input, not a traceback, is the story
                "schedule %s: its input does not fit workflow %s (%s); its ticks until %s are skipped",
                      name, wf.id, exc, following.isoformat())
            ticks = []
            state = {}
        fired = await self.store.fire_schedule(
            name, first, following, [(t, tick_instance_id(name, t)) for t in ticks],
            wf.version, wf.plan.plan_hash, wf.plan.start, state,
        )
        outcomes = [f[0] for f in fired]
        if "busy" in outcomes or "moved" in outcomes:
            self.counts.busy += 1
            return -1
        n = outcomes.count("started")
        self.counts.started += n
        self.counts.skipped += outcomes.count("skipped")
        if n:
            log.info("schedule %s started %d instance(s) of %s", name, n, wf.id)
        return n

    async def run(self, stopping: Callable[[], bool], interval: float = 1.0) -> None:
        """Fire due schedules until `stopping()`; a failure is logged and retried on the next round."""
        while not stopping():
            upcoming: float | None = None
            try:
                await self.fire_due()
                upcoming = await self.next_tick()
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any single failure
                log.warning("firing schedules failed (%s: %s)", type(exc).__name__, exc)
            delay = interval if upcoming is None else min(interval, max(upcoming, 0.01))
            await asyncio.sleep(delay)
