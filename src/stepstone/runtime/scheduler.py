"""The schedule firer: every worker runs one; whichever gets a due schedule's row starts its ticks.

    fire_due()   read the due schedules of the workflows this node has, choose each one's version as a
                 start of its workflow in the schedule's scope would (`authoring.selection`), compute its
                 ticks (catch-up policy, `scheduling.schedule.due_ticks`) and fire them in one statement
                 that locks its row with SKIP LOCKED and advances it (exactly one start per tick)
    next_tick()  seconds to the next tick this node can fire
    run()        fire_due, then sleep until the next tick or `interval`, whichever is first

A due schedule this node cannot fire is *held* until its next round: the database selects no version of
its workflow (an error line), or one this node lacks (a rolling deploy: left to the nodes that have it).
Its row is left as it is, so its ticks stay due, for another node or for the catch-up policy once a
version can take them; the round reads past it and `next_tick` does not wait for it, so a held schedule
costs one selection per round and never turns the loop into a poll.

`Worker.run_until_idle` fires first, so a test that moves the clock fires schedules by running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from stepstone.authoring.selection import SelectsVersions, selected_workflow
from stepstone.authoring.workflow import Registry, Workflow
from stepstone.errors import DatabaseUnavailable, DefinitionNotFound, VersionNotAdmitted
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
    """Fires the due schedules of the workflows in `registry`, each on the version `definitions` selects."""

    def __init__(self, store: SchedulingStore, registry: Registry, definitions: SelectsVersions) -> None:
        self.store = store
        self.registry = registry
        self.definitions = definitions
        self.counts = FiringCounts()
        self.held: frozenset[str] = frozenset()
        """The due schedules the last round could not fire (see the module docstring)."""
        self._told: dict[str, tuple[str, datetime]] = {}  # what was logged of a held schedule, and for which ticks

    @property
    def names(self) -> list[str]:
        """The workflows whose schedules this node fires."""
        return sorted({wf.id for wf in self.registry})

    async def next_tick(self) -> float | None:
        """Seconds to the next tick this node can fire, or None. Neither a schedule of a workflow it does not
        have nor one it held in its last round is its to wait for: counted, one overdue for a node that never
        comes turned every other node's loop into a poll every 10 ms."""
        names = self.names
        return await self.store.next_schedule(names, sorted(self.held)) if names else None

    async def fire_due(self) -> int:
        """Fire every due schedule this node can start; returns how many instances it started."""
        started = 0
        names = self.names
        held: set[str] = set()
        while names:
            progressed = False
            for row in await self.store.due_schedules(_BATCH, names, sorted(held)):
                outcome = await self._fire(row)
                if outcome is None:  # held: the next read passes it, so the rows behind it are reached
                    held.add(str(row["name"]))
                    progressed = True
                    continue
                started += max(outcome, 0)
                progressed = progressed or outcome >= 0
            if not progressed:
                break
        self.held = frozenset(held)
        self._told = {name: told for name, told in self._told.items() if name in held}
        return started

    async def _fire(self, row: dict[str, Any]) -> int | None:
        """Fire one schedule; returns instances started, -1 when another worker had or moved it, None when this
        node holds it (no version selected, one this node lacks, or one deprecated since it was selected)."""
        name = str(row["name"])
        spec = ScheduleSpec.from_document(row["spec"])
        first, now = row["next_fire_at"], row["now"]
        ticks, following = due_ticks(spec, first, now)
        wf = await self._version(name, str(row["definition_id"]), str(row["scope"]), following)
        if wf is None:
            return None
        try:
            state = wf.state_to_json({} if row["input"] is None else row["input"], what="schedule input")
        except Exception as exc:  # noqa: BLE001 - a bad stored input must not stop the other schedules
            log.error(  # noqa: TRY400 - one line: the input, not a traceback, is the story
                "schedule %s: its input does not fit workflow %s (%s); its ticks until %s are skipped",
                      name, wf.id, exc, following.isoformat())
            ticks = []
            state = {}
        try:
            fired = await self.store.fire_schedule(
                name, first, following, [(t, tick_instance_id(name, t)) for t in ticks],
                wf.version, wf.plan.plan_hash, wf.plan.start, state, wf.deadline, wf.plan.start_deadline,
            )
        except VersionNotAdmitted as exc:  # deprecated since it was selected: nothing was written
            self._tell(name, following, logging.WARNING, f"schedule {name}: {exc}; its version is selected again "
                       "at the next round")
            return None
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

    async def _version(self, name: str, workflow_id: str, scope: str, following: datetime) -> Workflow[Any] | None:
        """The version the schedule's instances run: the one a start of its workflow in its scope selects, as
        this node has it. None when the schedule is held (said once for each tick that comes due)."""
        try:
            wf = await selected_workflow(self.definitions, self.registry, workflow_id, scope, holder="this worker")
        except DefinitionNotFound as exc:  # a rolling deploy: firing it with another version would be wrong
            self._tell(name, following, logging.INFO, f"schedule {name}: {exc}; left to the workers that have it")
            return None
        if wf is None:
            self._tell(name, following, logging.ERROR,
                       f"schedule {name}: no version of workflow {workflow_id!r} takes new instances in scope "
                       f"{scope}: none is activated or AVAILABLE there or in the default scope; its due ticks are "
                       f"kept and fire by its catch_up policy once one is: make one AVAILABLE (`stepstone "
                       f"definitions reinstate {workflow_id} VERSION`) or deploy a new version")
        return wf

    def _tell(self, name: str, following: datetime, level: int, message: str) -> None:
        """Log why a schedule is held, once per reason and due tick, not at every round of the loop."""
        if self._told.get(name) != (message, following):
            self._told[name] = (message, following)
            log.log(level, "%s", message)

    async def run(self, stopping: Callable[[], bool], interval: float = 1.0) -> None:
        """Fire due schedules until `stopping()`; a failure is logged and retried on the next round."""
        while not stopping():
            upcoming: float | None = None
            try:
                await self.fire_due()
                upcoming = await self.next_tick()
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any single failure
                level = logging.DEBUG if isinstance(exc, DatabaseUnavailable) else logging.WARNING  # the claim
                log.log(level, "firing schedules failed (%s: %s)", type(exc).__name__, exc)  # loop tells an outage
            delay = interval if upcoming is None else min(interval, max(upcoming, 0.01))
            await asyncio.sleep(delay)
