# Generated from stepstone.client.Client by `python -m stepstone._gen_sync`: do not edit by hand.
# tests/test_sync_client.py fails when this file no longer matches Client.
"""The blocking face of `Client`: the same methods, run on a private event loop thread.

The starts and `Client`'s own operations are here; those of its other bases are in the `_sync_*`
modules named like theirs, mixed in."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstone._sync_loop import SyncLoop
from stepstone._sync_messages import SyncMessageOperations
from stepstone._sync_schedules import SyncScheduleOperations
from stepstone._sync_task_filters import SyncTaskFilterOperations
from stepstone._sync_tasks import SyncTaskOperations
from stepstone.client import Client

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from datetime import datetime, timedelta
    from typing import Any

    from stepstone.authoring.workflow import Registry, Workflow
    from stepstone.client import Cancellation, InstanceInfo
    from stepstone.config import Settings
    from stepstone.core.attribution import Actor
    from stepstone.core.limits import Limits
    from stepstone.ops import InstanceFilter
    from stepstone.ops.migration import MigrationReport
    from stepstone.ops.model import BulkReport, HistoryPage, InstanceDetail, InstancePage, ReplayResult

__all__ = ["SyncClient"]


class SyncClient(SyncScheduleOperations, SyncTaskOperations, SyncTaskFilterOperations, SyncMessageOperations, SyncLoop):
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
        self._start_loop()
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
        on_started: Callable[[int, list[str]], Any] | None = None,
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
        called after each batch (progress for long inputs), and `on_started(first, ids)` with the index of
        its first input and the ids it started: which inputs did start when a later batch fails or the
        call is interrupted (batches may end out of order)."""
        return self._run(self._client.start_many(
            workflow,
            inputs,
            idempotency_keys=idempotency_keys,
            business_keys=business_keys,
            scope=scope,
            deadline=deadline,
            batch_size=batch_size,
            on_batch=on_batch,
            on_started=on_started,
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
        """Every recorded event of the instance, oldest first; `position` is '' for the root's entries."""
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
        include_archived: bool = False,
    ) -> list[dict[str, Any]]:
        """Instances newest first; pass the last row's (created_at, id) as `after` for the next page.
        `scope` keeps the instances of one scope key (tenant). `limit` is taken from 1 to 1,000, as `find`
        takes it. Instances past their retention window (archived) are left out unless `include_archived`,
        as `find` leaves them out; a `status` must be one of `core.model.STATUSES`."""
        return self._run(self._client.list(
            status=status,
            definition=definition,
            business_key=business_key,
            after=after,
            limit=limit,
            scope=scope,
            include_archived=include_archived,
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
