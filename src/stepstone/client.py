"""Public operations on workflow instances: signal, cancel, retry, inspect, wait, migrate, and the operator's
calls of `stepstone.ops`. `Client` has the rest from its bases: starts (`client_starts.StartOperations`),
schedules and flow limits (`client_schedules.ScheduleOperations`), human tasks (`client_tasks.TaskOperations`)
and messages (`client_messages.MessageOperations`); what they share is `client_base.ClientBase`.

`Client` is async; `SyncClient` (`stepstone/_sync_client.py` and its `_sync_*` mixins) is generated from it by
`python -m stepstone._gen_sync`, never kept by hand. The CLI and the HTTP API call these same methods.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, Self, cast

from typing_extensions import TypeVar

from stepstone._waiting import wait_set
from stepstone.authoring.workflow import Registry, Workflow
from stepstone.client_base import _fingerprint
from stepstone.client_messages import MessageOperations
from stepstone.client_schedules import ScheduleOperations
from stepstone.client_tasks import TaskOperations
from stepstone.config import Settings
from stepstone.context import durable
from stepstone.core.attribution import Actor
from stepstone.core.failures import traceback_text
from stepstone.core.limits import Limits
from stepstone.core.model import COMPENSATION_FAILED, COMPLETED, FAILED, STATUSES, TERMINAL
from stepstone.errors import InvalidInput, UnknownSignal, WaitTimeout
from stepstone.observability import tracing
from stepstone.ops import InstanceFilter, Operations, migration
from stepstone.ops.contracts import explain_unknown_signal
from stepstone.ops.migration import DEFAULT_PATIENCE, MigrationReport
from stepstone.ops.model import BulkReport, HistoryPage, InstanceDetail, InstancePage, ReplayResult
from stepstone.ops.queries import MAX_PAGE
from stepstone.store.factory import open_ready_store
from stepstone.store.port import ClientStore, Store
from stepstone.store.settled import SettledWatch

SETTLED = TERMINAL | {FAILED, COMPENSATION_FAILED}
"""Statuses `wait_for` returns on: the instance will not move without an operator."""


@dataclass(frozen=True)
class InstanceInfo:
    """An instance as `get` shows it: where it is, what it holds and what it waits for."""

    id: str
    definition_id: str
    version: int
    status: str
    step: str | None
    state: Any
    waiting_for: Any
    next_timer_at: datetime | None
    parked_signals: int
    """The signals and messages parked with the instance (none of its other parked commands: a branch's
    report parked at a failed join is counted by that join after the retry, docs/branches.md)."""
    error: Any
    """Why it failed, when it did: `step`, `type`, `message`, `attempt`, and `frames` where its handler raised
    (`traceback` prints them; docs/api.md, "Failures"); None otherwise."""
    business_key: str | None
    created_at: datetime
    updated_at: datetime
    ended_at: datetime | None
    parent_id: str | None = None
    positions: list[dict[str, Any]] = field(default_factory=list)
    """The root ('') and every branch position: path, status, step, visit, wait, error."""
    children: list[dict[str, Any]] = field(default_factory=list)
    """Child instances this one started: id, definition_id, status, position."""
    archived_at: datetime | None = None
    """When retention archived it (it is left out of the lists unless asked for); None otherwise."""

    @property
    def completed(self) -> bool:
        return self.status == COMPLETED

    @property
    def traceback(self) -> str | None:
        """Where the failing handler raised, as Python prints a traceback; None when the error has no frames
        (no failure, a failure no handler raised, or one an earlier release stored)."""
        return traceback_text(self.error)


@dataclass(frozen=True)
class Cancellation:
    """What a cancel did: `outcome` is "cancelled", "compensating" (compensation runs first, then
    the instance is CANCELLED) or "unchanged" (it had already ended, or already compensates: a
    no-op); `status` is the instance's status afterwards."""

    instance_id: str
    outcome: str
    status: str

    @property
    def changed(self) -> bool:
        return self.outcome != "unchanged"


S_co = TypeVar("S_co", bound=ClientStore, default=ClientStore, covariant=True)


class Client(ScheduleOperations, TaskOperations, MessageOperations, Generic[S_co]):
    """Start and steer workflow instances, schedule them, work on their human tasks and publish messages.
    Open with `await Client.connect(...)`.

    Generic in its store, so that the store `connect` opens, which a `Worker` in the same process can
    share (`Worker(client.store, ...)`), is typed as the full `Store` it is; a bare `Client` is a
    `Client[ClientStore]`."""

    store: S_co

    def __init__(
        self, store: S_co, registry: Registry | None = None, *, limits: Limits | None = None,
        actor: str | Actor | None = None,
    ) -> None:
        """`actor` is who this client acts as, recorded on every command and history entry it writes
        (a name, or an `Actor` with a kind, a reason and on whose behalf)."""
        if isinstance(actor, Actor):
            actor = actor.encode()
        self.store = store
        self.registry = registry or Registry()
        self.limits = limits or Limits()
        self.actor = None if actor is None else self._text("actor", actor)
        self._registered: set[tuple[str, str, int]] = set()
        self._settled = SettledWatch(store)
        self._ops: Operations | None = None

    @classmethod
    async def connect(
        cls,
        database_url: str | None = None,
        *,
        schema: str | None = None,
        registry: Registry | None = None,
        settings: Settings | None = None,
        limits: Limits | None = None,
        actor: str | Actor | None = None,
    ) -> Client[Store]:
        """Connect to `database_url`, or to the configured (flags, environment, pyproject.toml) or
        embedded database. The schema must be migrated (`SchemaNotReady` otherwise), except on the
        embedded default, which is migrated here, saying so in one line on the log."""
        store = await open_ready_store(database_url, schema, settings=settings)
        # `cls`, so that a subclass connects as itself; typed as a client on the full store it opened.
        return cast("Client[Store]", cls(cast("S_co", store), registry, limits=limits, actor=actor))

    async def close(self) -> None:
        await self.detach()
        await self.store.close()

    async def detach(self) -> None:
        """Close what this client opened beside its store (the listener `wait_for` uses), leaving the
        store open: for a client made on a store its caller owns and closes."""
        await self._settled.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    # -- operations -----------------------------------------------------------------------------

    async def signal(
        self, instance_id: str, name: str, payload: Any = None, *, dedup_key: str | None = None, position: str = "",
        connection: Any = None,
    ) -> int:
        """Send a signal; returns its command id. A repeated dedup key applies once. `position` addresses
        one branch (its path, e.g. ``ship/2``); the default is the instance's root position. With
        `connection`, the signal is written by the caller's own transaction (as `start`)."""
        self._texts(empty=True, instance_id=instance_id)
        self._texts(signal_name=name, dedup_key=dedup_key, position=position or None)
        text = self._encode("signal payload", payload)
        fingerprint = _fingerprint(name, position, text) if position else _fingerprint(name, text)
        with tracing.span(f"stepstone.signal {name}", {"instance_id": instance_id, "signal": name,
                                                       "position": position or None}):
            context = durable.capture()
            try:
                if connection is not None:
                    return await self._caller_transaction(connection).signal_in(
                        connection, instance_id, name, payload, dedup_key=dedup_key, fingerprint=fingerprint,
                        actor=self.actor, position=position, context=context,
                    )
                return await self.store.signal(
                    instance_id, name, payload, dedup_key=dedup_key, fingerprint=fingerprint, actor=self.actor,
                    position=position, context=context,
                )
            except UnknownSignal as exc:  # the store refused it: name the pinned version that does not declare it
                raise await explain_unknown_signal(self.store.definitions, exc) from None

    async def cancel(self, instance_id: str, reason: str = "", *, compensate: bool = False) -> str:
        """Cancel an instance (idempotent); returns its status afterwards. Every open command is
        settled, one history entry each; with `compensate`, the completed steps are compensated
        first (the status is then COMPENSATING until it is CANCELLED). `cancellation` says more."""
        return (await self.cancellation(instance_id, reason, compensate=compensate)).status

    async def cancellation(self, instance_id: str, reason: str = "", *, compensate: bool = False) -> Cancellation:
        """Cancel, and say what it did: cancelled, compensating, or unchanged (a no-op on an
        instance that already ended)."""
        self._texts(empty=True, instance_id=instance_id)
        self._text("cancel reason", reason, free=True, empty=True)
        outcome, status = await self.store.cancel_saga(instance_id, reason, self.actor, compensate=compensate)
        return Cancellation(instance_id, outcome, status)

    async def compensations(self, instance_id: str) -> list[dict[str, Any]]:
        """The steps this instance completed that declare a compensation, in order of completion:
        step, position, what it recorded, status (PENDING, COMPENSATED, FAILED), attempts."""
        self._texts(empty=True, instance_id=instance_id)
        return await self.store.compensations(instance_id)

    async def retry(self, instance_id: str) -> None:
        """Re-drive the failed step of a FAILED instance, or resume the compensation of a
        COMPENSATION_FAILED one at the compensation it gave up."""
        self._texts(empty=True, instance_id=instance_id)
        await self.store.retry(instance_id, self.actor)

    async def get(self, instance_id: str) -> InstanceInfo:
        """Where the instance is, what it holds and what it waits for."""
        self._texts(empty=True, instance_id=instance_id)
        row = await self.store.get(instance_id)
        return InstanceInfo(
            id=row["id"], definition_id=row["definition_id"], version=row["version"], status=row["status"],
            step=row["step"], state=row["state"], waiting_for=row["wait"], next_timer_at=row["next_timer_at"],
            parked_signals=row["parked_signals"], error=row["error"], business_key=row["business_key"],
            created_at=row["created_at"], updated_at=row["updated_at"], ended_at=row["ended_at"],
            parent_id=None if row["parent_id"] is None else str(row["parent_id"]),
            positions=row["positions"], children=row["children"], archived_at=row["archived_at"],
        )

    async def history(self, instance_id: str) -> list[dict[str, Any]]:
        """Every recorded event of the instance, oldest first; `position` is '' for the root's entries."""
        self._texts(empty=True, instance_id=instance_id)
        return await self.store.history(instance_id)

    async def list(
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
        self._texts(empty=True, status=status, workflow=definition, business_key=business_key,
                    after_id=after[1] if after else None, scope=scope)
        if status is not None and status not in STATUSES:
            raise InvalidInput(f"status must be one of {', '.join(STATUSES)}, got {status!r}", what="status")
        return await self.store.list(
            status=status, definition=definition, business_key=business_key, after=after,
            limit=max(1, min(limit, MAX_PAGE)), scope=scope, include_archived=include_archived,
        )

    async def migrate(
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
        patience: float = DEFAULT_PATIENCE,
    ) -> MigrationReport:
        """Move instances (one id, a list, or every instance of `definition` v`from_version` that may still
        run) to the version of `to`; see docs/versions.md. Each is checked against the target plan
        before anything is written and answered migrated, refused (with why) or skipped. A single
        instance that is refused raises MigrationRefused; nothing of it changed. Each migration waits
        up to `patience` seconds for its turn behind the instance's queued commands."""
        await self._ensure_registered(to)
        chosen = instances if instances is None or isinstance(instances, str) else [*instances]
        report = await migration.migrate(
            self.store.definitions, chosen, to=to, definition=definition, from_version=from_version, scope=scope,
            step_map=step_map, state_transform=state_transform, dry_run=dry_run, actor=self.actor,
            patience=patience,
        )
        if isinstance(instances, str):
            report.raise_for_refusals()
        return report

    async def wait_for(self, instance_id: str, timeout: float = 30.0) -> InstanceInfo:
        """Wait until the instance completes, fails or is cancelled; WaitTimeout otherwise.

        Wakes on the notification the instance sends when it settles (one LISTEN connection per
        client, shared by every wait), with a slow re-read in case a notification is lost."""
        self._texts(empty=True, instance_id=instance_id)
        status = await self.store.status(instance_id)  # InstanceNotFound before anything listens
        if status in SETTLED:
            return await self.get(instance_id)
        key = str(uuid.UUID(instance_id))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        settled = await self._settled.watch(key)
        try:
            while True:
                settled.clear()  # before the read: a notification from here on is not lost
                status = await self.store.status(instance_id)
                if status in SETTLED:
                    return await self.get(instance_id)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise WaitTimeout(instance_id, status, timeout)
                await wait_set(settled, min(remaining, self._settled.fallback_seconds))
        finally:
            self._settled.unwatch(key, settled)

    # -- operations (stepstone.ops: the same calls the CLI and the HTTP API make) ---------------

    @property
    def operations(self) -> Operations:
        """The operator's toolbox on this client's store, acting as this client's actor."""
        if self._ops is None:
            self._ops = Operations.on(self.store, actor=self.actor)
        return self._ops

    async def find(
        self, where: InstanceFilter | None = None, *, after: tuple[datetime, str] | None = None, limit: int = 50
    ) -> InstancePage:
        """Instances matching a filter, newest first, keyset-paginated (`page.next_after`)."""
        return await self.operations.find(where, after=after, limit=limit)

    async def detail(self, instance_id: str) -> InstanceDetail:
        """One instance with positions, open commands, timers, children, outbox events, retries;
        sensitive values redacted."""
        self._texts(empty=True, instance_id=instance_id)
        return await self.operations.detail(instance_id)

    async def history_page(
        self, instance_id: str, *, after: int = 0, limit: int = 100, failed_only: bool = False
    ) -> HistoryPage:
        """History entries with actor, outcome and patch, oldest first, `limit` at a time."""
        self._texts(empty=True, instance_id=instance_id)
        return await self.operations.history(instance_id, after=after, limit=limit, failed_only=failed_only)

    async def retry_many(
        self, ids: Sequence[str] | None = None, *, where: InstanceFilter | None = None, dry_run: bool = False
    ) -> BulkReport:
        """Retry the given instances or every one matching `where`; a result per instance."""
        return await self.operations.retry(ids, where=where, dry_run=dry_run)

    async def replay(self, instance_id: str, step: str) -> ReplayResult:
        """Run `step` again on the state the instance had when it reached it; history keeps the old path."""
        self._texts(empty=True, instance_id=instance_id)
        self._text("step", step)
        return await self.operations.replay(instance_id, step)
