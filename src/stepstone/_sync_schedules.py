# Generated from stepstone.client.Client by `python -m stepstone._gen_sync`: do not edit by hand.
# tests/test_sync_client.py fails when this file no longer matches Client.
"""The blocking face of `ScheduleOperations` (`stepstone.client_schedules`), mixed into `SyncClient`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstone._sync_loop import SyncLoop

if TYPE_CHECKING:
    from typing import Any

    from stepstone.authoring.workflow import Workflow
    from stepstone.scheduling.operations import FlowLimits, ScheduleInfo, Schedules
    from stepstone.scheduling.schedule import Schedule

__all__ = ["SyncScheduleOperations"]


class SyncScheduleOperations(SyncLoop):
    """`ScheduleOperations`'s operations as blocking calls."""

    def schedule(self, schedule: Schedule) -> ScheduleInfo:
        """Create or replace a schedule; any worker that has its workflow fires it. Declaring it again
        unchanged (at every deploy) keeps its next tick. Its input is checked against the version its ticks
        will start: the one a start of the workflow selects in the schedule's scope."""
        return self._run(self._client.schedule(schedule))

    def schedules(self, name: str | None = None) -> Schedules:
        """Every schedule by name (or the one named; ScheduleNotFound when there is none)."""
        return self._run(self._client.schedules(name))

    def pause_schedule(self, name: str) -> None:
        self._run(self._client.pause_schedule(name))

    def resume_schedule(self, name: str) -> ScheduleInfo:
        """Resume from the next tick after now: ticks missed while paused do not fire."""
        return self._run(self._client.resume_schedule(name))

    def delete_schedule(self, name: str) -> None:
        self._run(self._client.delete_schedule(name))

    def trigger_schedule(self, name: str) -> str:
        """Start the schedule's workflow now, with its input, outside its ticks; returns the instance id."""
        return self._run(self._client.trigger_schedule(name))

    def set_flow_limit(
        self,
        workflow: Workflow[Any] | str,
        *,
        max_running: int | None = None,
        key: str | None = None,
        min_interval: float | None = None,
        scope: str = "default",
    ) -> int:
        """At most `max_running` instances of the workflow in `scope` run at once (per value of `key`:
        'business_key' or a top-level state field), starts at least `min_interval` seconds apart; the rest wait
        as rows, in start order. Instances of other scopes are not counted. Returns how many waiting instances
        the new limit admitted at once."""
        return self._run(self._client.set_flow_limit(
            workflow,
            max_running=max_running,
            key=key,
            min_interval=min_interval,
            scope=scope,
        ))

    def remove_flow_limit(self, workflow: Workflow[Any] | str, *, scope: str = "default") -> int:
        """Remove the workflow's limit in `scope`; returns how many waiting instances it released."""
        return self._run(self._client.remove_flow_limit(workflow, scope=scope))

    def flow_limits(self, workflow: Workflow[Any] | str | None = None, *, scope: str | None = None) -> FlowLimits:
        """The flow limits (of one workflow, or all; of one scope, or every scope's), with how many instances
        of each run and wait now."""
        return self._run(self._client.flow_limits(workflow, scope=scope))
