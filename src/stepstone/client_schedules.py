"""Schedules and flow limits on `Client` (docs/schedules.md): declare, list, pause, resume, delete and
trigger schedules; set, remove and list the flow limits that hold starts back.

`ScheduleOperations` is a base of `Client`; it builds on `StartOperations`, since triggering a schedule
starts its workflow. The work is `stepstone.scheduling.operations`, on a store that keeps schedules
(`SchedulingStore`).
"""

from __future__ import annotations

import uuid
from typing import Any

from stepstone.authoring.selection import selected_workflow
from stepstone.authoring.workflow import Registry, Workflow
from stepstone.client_starts import StartOperations
from stepstone.core.pin import DEFAULT_SCOPE
from stepstone.errors import DefinitionNotFound
from stepstone.scheduling import operations as scheduling
from stepstone.scheduling.operations import FlowLimits, ScheduleInfo, Schedules
from stepstone.scheduling.schedule import Schedule
from stepstone.store.scheduling_port import SchedulingStore

__all__ = ["ScheduleOperations"]


class ScheduleOperations(StartOperations):
    """The schedules and flow limits of `Client` (its attributes are set by `Client.__init__`)."""

    async def schedule(self, schedule: Schedule) -> ScheduleInfo:
        """Create or replace a schedule; any worker that has its workflow fires it. Declaring it again
        unchanged (at every deploy) keeps its next tick. Its input is checked against the version its ticks
        will start: the one a start of the workflow selects in the schedule's scope."""
        self._text("schedule name", schedule.name)
        self._scope(schedule.scope)
        self._text("workflow", schedule.workflow_id)
        if isinstance(schedule.workflow, Workflow):
            await self._ensure_registered(schedule.workflow)
        state = schedule.input
        wf = await self._schedule_version(schedule)
        if wf is not None:
            state = wf.state_to_json({} if schedule.input is None else schedule.input, what="schedule input")
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
        return await self.start(info.workflow, info.input, idempotency_key=f"schedule:{name}:trigger:{uuid.uuid4()}",
                                scope=info.scope)

    async def set_flow_limit(
        self, workflow: Workflow[Any] | str, *, max_running: int | None = None, key: str | None = None,
        min_interval: float | None = None, scope: str = DEFAULT_SCOPE,
    ) -> int:
        """At most `max_running` instances of the workflow in `scope` run at once (per value of `key`:
        'business_key' or a top-level state field), starts at least `min_interval` seconds apart; the rest wait
        as rows, in start order. Instances of other scopes are not counted. Returns how many waiting instances
        the new limit admitted at once."""
        workflow_id = self._workflow_id(workflow)
        return await scheduling.put_flow_limit(
            self._scheduling(), workflow_id, max_running=max_running, key=key, min_interval=min_interval,
            scope=self._scope(scope),
        )

    async def remove_flow_limit(self, workflow: Workflow[Any] | str, *, scope: str = DEFAULT_SCOPE) -> int:
        """Remove the workflow's limit in `scope`; returns how many waiting instances it released."""
        workflow_id = self._workflow_id(workflow)
        return (await self._scheduling().delete_flow_limit(self._scope(scope), workflow_id))[1]

    async def flow_limits(
        self, workflow: Workflow[Any] | str | None = None, *, scope: str | None = None,
    ) -> FlowLimits:
        """The flow limits (of one workflow, or all; of one scope, or every scope's), with how many instances
        of each run and wait now."""
        workflow_id = None if workflow is None else self._workflow_id(workflow)
        return await scheduling.flow_limits(self._scheduling(), workflow_id,
                                            None if scope is None else self._scope(scope))

    # -- helpers --------------------------------------------------------------------------------

    async def _schedule_version(self, schedule: Schedule) -> Workflow[Any] | None:
        """The version the schedule's ticks start, as the scheduler chooses it (`selected_workflow` in its
        scope), from this client's registry and the Workflow given. While no version is selected (the
        scheduler holds the schedule until one is), the Workflow given or the registry's newest. None when
        this client lacks the selected version: the scheduler checks the input when it fires."""
        given = schedule.workflow if isinstance(schedule.workflow, Workflow) else None
        known = self.registry if given is None else Registry(
            given, *(wf for wf in self.registry if (wf.id, wf.version) != (given.id, given.version)))
        try:
            wf = await selected_workflow(self.store.definitions, known, schedule.workflow_id, schedule.scope,
                                         holder="this client's registry")
        except DefinitionNotFound:
            return None
        return wf or known.latest(schedule.workflow_id)

    def _workflow_id(self, workflow: Workflow[Any] | str) -> str:
        """A flow limit's workflow, named or given (as `set_flow_limit` and `remove_flow_limit` take it)."""
        workflow_id = workflow if isinstance(workflow, str) else workflow.id
        self._text("workflow", workflow_id)
        return workflow_id

    def _scheduling(self) -> SchedulingStore:
        if not isinstance(self.store, SchedulingStore):
            raise TypeError(f"{type(self.store).__name__} does not keep schedules or flow limits")
        return self.store
