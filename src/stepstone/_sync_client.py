# Generated from stepstone.client.Client by `python -m stepstone._gen_sync`: do not edit by hand.
# tests/test_sync_client.py fails when this file no longer matches Client.
"""The blocking face of `Client`: the same methods, run on a private event loop thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from stepstone.client import Client

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from datetime import datetime, timedelta

    from stepstone.authoring.workflow import Registry, Workflow
    from stepstone.client import Cancellation, InstanceInfo
    from stepstone.client_messages import Published, SignalledOrStarted
    from stepstone.client_tasks import BulkReassignment, SavedTaskFilter, TaskCompletion, TaskFilter, TaskInfo, TaskPage
    from stepstone.config import Settings
    from stepstone.core.attribution import Actor
    from stepstone.core.limits import Limits
    from stepstone.ops import InstanceFilter
    from stepstone.ops.migration import MigrationReport
    from stepstone.ops.model import BulkReport, HistoryPage, InstanceDetail, InstancePage, ReplayResult
    from stepstone.scheduling.operations import FlowLimits, ScheduleInfo, Schedules
    from stepstone.scheduling.schedule import Schedule

__all__ = ["SyncClient"]

T = TypeVar("T")


class SyncClient:
    """`Client`'s operations as blocking calls; open it like `Client.connect`, close it (or use `with`)."""

    def __init__(
        self,
        database_url: str | None = None,
        *,
        schema: str | None = None,
        registry: Registry | None = None,
        settings: Settings | None = None,
        limits: Limits | None = None,
        actor: str | Actor | None = None,
    ) -> None:
        """Connect to `database_url`, or to the configured (flags, environment, pyproject.toml) or
        embedded database. The schema must be migrated (`SchemaNotReady` otherwise), except on the
        embedded default, which is migrated here, saying so in one line on the log."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="stepstone-client", daemon=True)
        self._thread.start()
        try:
            self._client: Client = self._run(Client.connect(
                database_url,
                schema=schema,
                registry=registry,
                settings=settings,
                limits=limits,
                actor=actor,
            ))
        except BaseException:
            self._stop_loop()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    @property
    def client(self) -> Client:
        """The async `Client` underneath (its coroutines run on this object's loop thread only)."""
        return self._client

    def close(self) -> None:
        """Close the connection pool and stop the loop thread."""
        try:
            self._run(self._client.close())
        finally:
            self._stop_loop()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def start(
        self,
        workflow: Workflow[Any] | str,
        input: Any = None,  # noqa: A002 - the same name as Client's parameter
        *,
        idempotency_key: str | None = None,
        business_key: str | None = None,
        scope: str = "default",
        deadline: timedelta | float | datetime | None = None,
        connection: Any = None,
    ) -> str:
        """Start an instance; returns its id. The same key with the same input returns the
        same instance; the same key with other input raises IdempotencyConflict.

        A workflow named by id runs the version the scope's activation selects (the default scope's when
        the scope has none; the highest AVAILABLE version when nothing was activated); a `Workflow`
        runs its own version. Either way the instance is pinned to that version, and a version that is
        not AVAILABLE is refused (VersionNotAdmitted). `deadline` (a duration from now on the database
        clock, or an instant; default the workflow's) times the instance out: it becomes TIMED_OUT after
        compensating what it completed.

        With `connection` (asyncpg, psycopg 3, or a SQLAlchemy connection or session) the start is
        written by the caller's own transaction: it happens when that commits and not at all when it
        rolls back (docs/integrations.md)."""
        return self._run(self._client.start(
            workflow,
            input,
            idempotency_key=idempotency_key,
            business_key=business_key,
            scope=scope,
            deadline=deadline,
            connection=connection,
        ))

    def start_many(
        self,
        workflow: Workflow[Any] | str,
        inputs: Sequence[Any],
        *,
        idempotency_keys: Sequence[str | None] | None = None,
        business_keys: Sequence[str | None] | None = None,
        scope: str = "default",
        deadline: timedelta | float | datetime | None = None,
        batch_size: int = 1000,
        on_batch: Callable[[int, int], Any] | None = None,
    ) -> list[str]:
        """Start one instance per input; returns their ids in input order. The instances are written
        `batch_size` at a time, each batch in one statement and one transaction, two batches at a time
        (docs/performance.md has the rates): every instance of a batch starts, or none does.

        Each item follows `start`'s rules: `idempotency_keys[i]` and `business_keys[i]` (lists as long
        as `inputs`; None where an item has none) work as the keyword arguments of `start` do. A key
        used before with the same input gives the earlier instance's id; with other input the batch
        holding it starts nothing and IdempotencyConflict is raised, as BusinessKeyInUse is for a
        business key in use. Other batches may have started (the ones sent before, and the one in
        flight beside it); calling again with the same inputs and idempotency keys starts only what
        is missing. `on_batch(started, total)` is
        called after each batch (progress for long inputs)."""
        return self._run(self._client.start_many(
            workflow,
            inputs,
            idempotency_keys=idempotency_keys,
            business_keys=business_keys,
            scope=scope,
            deadline=deadline,
            batch_size=batch_size,
            on_batch=on_batch,
        ))

    def detach(self, ) -> None:
        """Close what this client opened beside its store (the listener `wait_for` uses), leaving the
        store open: for a client made on a store its caller owns and closes."""
        self._run(self._client.detach())

    def signal(
        self,
        instance_id: str,
        name: str,
        payload: Any = None,
        *,
        dedup_key: str | None = None,
        position: str = "",
        connection: Any = None,
    ) -> int:
        """Send a signal; returns its command id. A repeated dedup key applies once. `position` addresses
        one branch (its path, e.g. ``ship/2``); the default is the instance's root position. With
        `connection`, the signal is written by the caller's own transaction (as `start`)."""
        return self._run(self._client.signal(
            instance_id,
            name,
            payload,
            dedup_key=dedup_key,
            position=position,
            connection=connection,
        ))

    def cancel(self, instance_id: str, reason: str = "", *, compensate: bool = False) -> str:
        """Cancel an instance (idempotent); returns its status afterwards. Every open command is
        settled, one history entry each; with `compensate`, the completed steps are compensated
        first (the status is then COMPENSATING until it is CANCELLED). `cancellation` says more."""
        return self._run(self._client.cancel(instance_id, reason, compensate=compensate))

    def cancellation(self, instance_id: str, reason: str = "", *, compensate: bool = False) -> Cancellation:
        """Cancel, and say what it did: cancelled, compensating, or unchanged (a no-op on an
        instance that already ended)."""
        return self._run(self._client.cancellation(instance_id, reason, compensate=compensate))

    def compensations(self, instance_id: str) -> list[dict[str, Any]]:
        """The steps this instance completed that declare a compensation, in order of completion:
        step, position, what it recorded, status (PENDING, COMPENSATED, FAILED), attempts."""
        return self._run(self._client.compensations(instance_id))

    def retry(self, instance_id: str) -> None:
        """Re-drive the failed step of a FAILED instance, or resume the compensation of a
        COMPENSATION_FAILED one at the compensation it gave up."""
        self._run(self._client.retry(instance_id))

    def get(self, instance_id: str) -> InstanceInfo:
        """Where the instance is, what it holds and what it waits for."""
        return self._run(self._client.get(instance_id))

    def history(self, instance_id: str) -> list[dict[str, Any]]:
        """Every recorded event of the instance, oldest first."""
        return self._run(self._client.history(instance_id))

    def list(
        self,
        *,
        status: str | None = None,
        definition: str | None = None,
        business_key: str | None = None,
        after: tuple[datetime, str] | None = None,
        limit: int = 50,
        scope: str | None = None,
    ) -> list[dict[str, Any]]:
        """Instances newest first; pass the last row's (created_at, id) as `after` for the next page.
        `scope` keeps the instances of one scope key (tenant)."""
        return self._run(self._client.list(
            status=status,
            definition=definition,
            business_key=business_key,
            after=after,
            limit=limit,
            scope=scope,
        ))

    def migrate(
        self,
        instances: str | Sequence[str] | None = None,
        *,
        to: Workflow[Any],
        definition: str | None = None,
        from_version: int | None = None,
        scope: str | None = None,
        step_map: dict[str, str] | None = None,
        state_transform: Callable[[Any], Any] | None = None,
        dry_run: bool = False,
        patience: float = 30.0,
    ) -> MigrationReport:
        """Move instances (one id, a list, or every instance of `definition` v`from_version` that may still
        run) to the version of `to`; see docs/versions.md. Each is checked against the target plan
        before anything is written and answered migrated, refused (with why) or skipped. A single
        instance that is refused raises MigrationRefused; nothing of it changed. Each migration waits
        up to `patience` seconds for its turn behind the instance's queued commands."""
        return self._run(self._client.migrate(
            instances,
            to=to,
            definition=definition,
            from_version=from_version,
            scope=scope,
            step_map=step_map,
            state_transform=state_transform,
            dry_run=dry_run,
            patience=patience,
        ))

    def wait_for(self, instance_id: str, timeout: float = 30.0) -> InstanceInfo:
        """Wait until the instance completes, fails or is cancelled; WaitTimeout otherwise.

        Wakes on the notification the instance sends when it settles (one LISTEN connection per
        client, shared by every wait), with a slow re-read in case a notification is lost."""
        return self._run(self._client.wait_for(instance_id, timeout))

    def find(
        self,
        where: InstanceFilter | None = None,
        *,
        after: tuple[datetime, str] | None = None,
        limit: int = 50,
    ) -> InstancePage:
        """Instances matching a filter, newest first, keyset-paginated (`page.next_after`)."""
        return self._run(self._client.find(where, after=after, limit=limit))

    def detail(self, instance_id: str) -> InstanceDetail:
        """One instance with positions, open commands, timers, children, outbox events, retries;
        sensitive values redacted."""
        return self._run(self._client.detail(instance_id))

    def history_page(
        self,
        instance_id: str,
        *,
        after: int = 0,
        limit: int = 100,
        failed_only: bool = False,
    ) -> HistoryPage:
        """History entries with actor, outcome and patch, oldest first, `limit` at a time."""
        return self._run(self._client.history_page(instance_id, after=after, limit=limit, failed_only=failed_only))

    def retry_many(
        self,
        ids: Sequence[str] | None = None,
        *,
        where: InstanceFilter | None = None,
        dry_run: bool = False,
    ) -> BulkReport:
        """Retry the given instances or every one matching `where`; a result per instance."""
        return self._run(self._client.retry_many(ids, where=where, dry_run=dry_run))

    def replay(self, instance_id: str, step: str) -> ReplayResult:
        """Run `step` again on the state the instance had when it reached it; history keeps the old path."""
        return self._run(self._client.replay(instance_id, step))

    def schedule(self, schedule: Schedule) -> ScheduleInfo:
        """Create or replace a schedule; any worker that has its workflow fires it. Declaring it again
        unchanged (at every deploy) keeps its next tick."""
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
    ) -> int:
        """At most `max_running` instances of the workflow run at once (per value of `key`: 'business_key' or a
        top-level state field), starts at least `min_interval` seconds apart; the rest wait as rows, in start
        order. Returns how many waiting instances the new limit admitted at once."""
        return self._run(self._client.set_flow_limit(
            workflow,
            max_running=max_running,
            key=key,
            min_interval=min_interval,
        ))

    def remove_flow_limit(self, workflow: Workflow[Any] | str) -> int:
        """Remove the workflow's limit; returns how many waiting instances it released."""
        return self._run(self._client.remove_flow_limit(workflow))

    def flow_limits(self, workflow: str | None = None) -> FlowLimits:
        """The flow limits, with how many instances of each workflow run and wait now."""
        return self._run(self._client.flow_limits(workflow))

    def task(self, task_id: str) -> TaskInfo:
        """One task, any status."""
        return self._run(self._client.task(task_id))

    def tasks(
        self,
        *,
        user: str | None = None,
        groups: Sequence[str] = (),
        mode: str | None = None,
        where: TaskFilter | None = None,
        after: str | None = None,
        limit: int = 50,
        saved_filter: str | None = None,
        scope: str | None = None,
    ) -> TaskPage:
        """Open tasks (OPEN or COMPLETING) in inbox order: priority first, then oldest. `mode` (default
        inbox): inbox (the user's tasks, and unassigned ones offered to the user or their groups),
        assigned, candidate, or all (every open task; `user` and `groups` then filter by assignee and
        candidate group). `where` narrows it further. `saved_filter` names a filter `user` saved in
        `scope` (default scope unless given): its mode and its `where` (then neither may be passed)."""
        return self._run(self._client.tasks(
            user=user,
            groups=groups,
            mode=mode,
            where=where,
            after=after,
            limit=limit,
            saved_filter=saved_filter,
            scope=scope,
        ))

    def count_tasks(
        self,
        *,
        user: str | None = None,
        groups: Sequence[str] = (),
        mode: str | None = None,
        where: TaskFilter | None = None,
        saved_filter: str | None = None,
        scope: str | None = None,
    ) -> int:
        """How many open tasks `tasks` would list with the same arguments, without fetching them."""
        return self._run(self._client.count_tasks(
            user=user,
            groups=groups,
            mode=mode,
            where=where,
            saved_filter=saved_filter,
            scope=scope,
        ))

    def instance_tasks(self, instance_id: str) -> tuple[dict[str, Any], ...]:
        """Every task an instance opened, oldest first (id, position, step, visit, status, title, assignee)."""
        return self._run(self._client.instance_tasks(instance_id))

    def claim_task(
        self,
        task_id: str,
        *,
        actor: str | None = None,
        groups: Sequence[str] = (),
        admin: bool = False,
    ) -> TaskInfo:
        """Take an unassigned task as its assignee. A task someone else holds is refused (`TaskHeld`)
        unless `admin` (recorded); claiming one's own task again changes nothing."""
        return self._run(self._client.claim_task(task_id, actor=actor, groups=groups, admin=admin))

    def unclaim_task(self, task_id: str, *, actor: str | None = None, admin: bool = False) -> TaskInfo:
        """Give a task back to its candidates (only its assignee, or an admin)."""
        return self._run(self._client.unclaim_task(task_id, actor=actor, admin=admin))

    def reassign_task(
        self,
        task_id: str,
        to: str,
        *,
        actor: str | None = None,
        reason: str = "",
        idempotency_key: str | None = None,
        admin: bool = False,
    ) -> TaskInfo:
        """Give a task to another user (its assignee, its owner or an admin may)."""
        return self._run(self._client.reassign_task(
            task_id,
            to,
            actor=actor,
            reason=reason,
            idempotency_key=idempotency_key,
            admin=admin,
        ))

    def delegate_task(
        self,
        task_id: str,
        to: str,
        *,
        actor: str | None = None,
        reason: str = "",
        idempotency_key: str | None = None,
        admin: bool = False,
    ) -> TaskInfo:
        """Delegate a task: `to` works on it and `resolve_task` gives it back to its owner (the assignee
        who delegated it, unless the task had an owner already)."""
        return self._run(self._client.delegate_task(
            task_id,
            to,
            actor=actor,
            reason=reason,
            idempotency_key=idempotency_key,
            admin=admin,
        ))

    def resolve_task(self, task_id: str, *, actor: str | None = None, admin: bool = False) -> TaskInfo:
        """The delegate hands a delegated task back to its owner."""
        return self._run(self._client.resolve_task(task_id, actor=actor, admin=admin))

    def complete_task(
        self,
        task_id: str,
        decision: str,
        payload: Any = None,
        *,
        actor: str | None = None,
        groups: Sequence[str] = (),
        idempotency_key: str | None = None,
        reviewed_version: int | None = None,
        admin: bool = False,
    ) -> TaskCompletion:
        """Complete a task with one of its decisions and that decision's payload (validated by its model).

        Refused with a typed error, nothing changed: an unknown decision (`UnknownDecision`), a payload
        failing its model (`InvalidInput`), an actor who is neither assignee, owner nor candidate
        (`TaskNotPermitted`, unless `admin`), a task not OPEN (`TaskNotOpen`, carrying the completion
        that won), a changed state where the task requires version stability (`StateChangedSinceReview`).
        The same `idempotency_key` with the same decision and payload returns the earlier completion;
        with another, `IdempotencyConflict`."""
        return self._run(self._client.complete_task(
            task_id,
            decision,
            payload,
            actor=actor,
            groups=groups,
            idempotency_key=idempotency_key,
            reviewed_version=reviewed_version,
            admin=admin,
        ))

    def reassign_all_tasks(
        self,
        from_user: str,
        to_user: str,
        *,
        actor: str | None = None,
        reason: str = "",
        dry_run: bool = False,
    ) -> BulkReassignment:
        """Move every open task of `from_user` to `to_user` (an absent colleague's), each with a history
        entry; tasks being completed are skipped and counted. `dry_run` counts and changes nothing."""
        return self._run(self._client.reassign_all_tasks(
            from_user,
            to_user,
            actor=actor,
            reason=reason,
            dry_run=dry_run,
        ))

    def save_task_filter(
        self,
        name: str,
        *,
        user: str,
        mode: str = "inbox",
        where: TaskFilter | None = None,
        scope: str = "default",
    ) -> SavedTaskFilter:
        """Save (or replace) the user's inbox filter `name` in `scope`. `where.scope`, when given, must be
        `scope`: a filter only ever shows its own scope's tasks."""
        return self._run(self._client.save_task_filter(name, user=user, mode=mode, where=where, scope=scope))

    def task_filters(self, *, user: str, scope: str = "default") -> tuple[SavedTaskFilter, ...]:
        """The user's saved filters in `scope`, by name."""
        return self._run(self._client.task_filters(user=user, scope=scope))

    def task_filter(self, name: str, *, user: str, scope: str = "default") -> SavedTaskFilter:
        """One saved filter; `TaskFilterNotFound` when the user has none of that name in `scope`."""
        return self._run(self._client.task_filter(name, user=user, scope=scope))

    def delete_task_filter(self, name: str, *, user: str, scope: str = "default") -> bool:
        """Delete a saved filter; False when there was none of that name."""
        return self._run(self._client.delete_task_filter(name, user=user, scope=scope))

    def publish_message(
        self,
        name: str,
        correlation_key: str,
        payload: Any = None,
        *,
        message_id: str | None = None,
        ttl: float | None = None,
        correlate_all: bool = False,
        connection: Any = None,
    ) -> Published:
        """Deliver a message to the oldest open subscription of (`name`, `correlation_key`), or to every
        one with `correlate_all`; buffer it for `ttl` seconds when none is open, else drop it. The same
        `message_id` with the same content answers as before; with other content, IdempotencyConflict.
        With `connection`, the message is written by the caller's own transaction (as `start`)."""
        return self._run(self._client.publish_message(
            name,
            correlation_key,
            payload,
            message_id=message_id,
            ttl=ttl,
            correlate_all=correlate_all,
            connection=connection,
        ))

    def start_or_signal(
        self,
        workflow: Workflow[Any] | str,
        business_key: str,
        signal: str,
        payload: Any = None,
        *,
        input: Any = None,  # noqa: A002 - the same name as Client's parameter
        dedup_key: str | None = None,
        scope: str = "default",
    ) -> SignalledOrStarted:
        """Signal the instance of `workflow` with `business_key`, starting it with `input` first when
        none has the key, in one transaction: two concurrent calls start one instance and both signal it.
        A signal sent before the instance reaches a wait that takes it waits (parked) until it does.
        `scope` is the scope key (tenant) the business key belongs to, and the new instance's scope."""
        return self._run(self._client.start_or_signal(
            workflow,
            business_key,
            signal,
            payload,
            input=input,
            dedup_key=dedup_key,
            scope=scope,
        ))
