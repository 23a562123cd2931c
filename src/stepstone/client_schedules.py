"""Schedules and flow limits on `Client` (docs/schedules.md): declare, list, pause, resume, delete and
trigger schedules; set, remove and list the flow limits that hold starts back.

`ScheduleOperations` is a base of `Client`; it builds on `StartOperations`, since triggering a schedule
starts its workflow. The work is `stepstone.scheduling.operations`, on a store that keeps schedules
(`SchedulingStore`).
"""

from __future__ import annotations

import uuid
from typing import Any

from stepstone.authoring.workflow import Workflow
from stepstone.client_starts import StartOperations
from stepstone.scheduling import operations as scheduling
from stepstone.scheduling.operations import FlowLimits, ScheduleInfo, Schedules
from stepstone.scheduling.schedule import Schedule
from stepstone.store.scheduling_port import SchedulingStore

__all__ = ["ScheduleOperations"]


class ScheduleOperations(StartOperations):
    """The schedules and flow limits of `Client` (its attributes are set by `Client.__init__`)."""

    async def schedule(self, schedule: Schedule) -> ScheduleInfo:
        """Create or replace a schedule; any worker that has its workflow fires it. Declaring it again
        unchanged (at every deploy) keeps its next tick."""
        self._text("schedule name", schedule.name)
        state = schedule.input
        wf = self.registry.latest(schedule.workflow_id) if isinstance(schedule.workflow, str) else schedule.workflow
        if wf is not None:
            state = wf.state_to_json({} if schedule.input is None else schedule.input, what="schedule input")
            await self._ensure_registered(wf)
        self._encode("schedule input", state)
        return await scheduling.put_schedule(self._scheduling(), schedule, state)

    async def schedules(self, name: str | None = None) -> Schedules:
        """Every schedule by name (or the one named; ScheduleNotFound when there is none)."""
        if name is not None:
            self._text("schedule name", name)
        return await scheduling.list_schedules(self._scheduling(), name)

    async def pause_schedule(self, name: str) -> None:
        self._text("schedule name", name)
        await scheduling.pause_schedule(self._scheduling(), name)

    async def resume_schedule(self, name: str) -> ScheduleInfo:
        """Resume from the next tick after now: ticks missed while paused do not fire."""
        self._text("schedule name", name)
        return await scheduling.resume_schedule(self._scheduling(), name)

    async def delete_schedule(self, name: str) -> None:
        self._text("schedule name", name)
        await scheduling.delete_schedule(self._scheduling(), name)

    async def trigger_schedule(self, name: str) -> str:
        """Start the schedule's workflow now, with its input, outside its ticks; returns the instance id."""
        self._text("schedule name", name)
        info = (await scheduling.list_schedules(self._scheduling(), name))[0]
        return await self.start(info.workflow, info.input, idempotency_key=f"schedule:{name}:trigger:{uuid.uuid4()}")

    async def set_flow_limit(
        self, workflow: Workflow[Any] | str, *, max_running: int | None = None, key: str | None = None,
        min_interval: float | None = None,
    ) -> int:
        """At most `max_running` instances of the workflow run at once (per value of `key`: 'business_key' or a
        top-level state field), starts at least `min_interval` seconds apart; the rest wait as rows, in start
        order. Returns how many waiting instances the new limit admitted at once."""
        workflow_id = self._workflow_id(workflow)
        return await scheduling.put_flow_limit(
            self._scheduling(), workflow_id, max_running=max_running, key=key, min_interval=min_interval,
        )

    async def remove_flow_limit(self, workflow: Workflow[Any] | str) -> int:
        """Remove the workflow's limit; returns how many waiting instances it released."""
        return (await self._scheduling().delete_flow_limit(self._workflow_id(workflow)))[1]

    async def flow_limits(self, workflow: Workflow[Any] | str | None = None) -> FlowLimits:
        """The flow limits (of one workflow, or all), with how many instances of each run and wait now."""
        workflow_id = None if workflow is None else self._workflow_id(workflow)
        return await scheduling.flow_limits(self._scheduling(), workflow_id)

    # -- helpers --------------------------------------------------------------------------------

    def _workflow_id(self, workflow: Workflow[Any] | str) -> str:
        """A flow limit's workflow, named or given (as `set_flow_limit` and `remove_flow_limit` take it)."""
        workflow_id = workflow if isinstance(workflow, str) else workflow.id
        self._text("workflow", workflow_id)
        return workflow_id

    def _scheduling(self) -> SchedulingStore:
        if not isinstance(self.store, SchedulingStore):
            raise TypeError(f"{type(self.store).__name__} does not keep schedules or flow limits")
        return self.store
