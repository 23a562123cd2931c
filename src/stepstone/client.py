"""Public operations on workflow instances: start, signal, cancel, retry, inspect, wait; human tasks
(`client_tasks.TaskOperations`) and messages (`client_messages.MessageOperations`).

`Client` is async; `SyncClient` (`stepstone/_sync_client.py`) is generated from it by
`python -m stepstone._gen_sync`, never kept by hand. The CLI and the HTTP API call these same methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from stepstone.authoring.workflow import Registry, Workflow
from stepstone.client_messages import MessageOperations, deadline_fields
from stepstone.client_tasks import TaskOperations
from stepstone.config import Settings
from stepstone.context import durable
from stepstone.core.attribution import Actor
from stepstone.core.limits import Limits, PayloadRejected
from stepstone.core.model import COMPENSATION_FAILED, COMPLETED, FAILED, TERMINAL
from stepstone.core.pin import DEFAULT_SCOPE, pin_of
from stepstone.errors import (
    DefinitionNotFound,
    InvalidInput,
    PayloadTooDeep,
    PayloadTooLarge,
    UnknownSignal,
    WaitTimeout,
)
from stepstone.ids import new_instance_id
from stepstone.observability import tracing
from stepstone.ops import InstanceFilter, Operations, migration
from stepstone.ops.contracts import explain_unknown_signal
from stepstone.ops.migration import DEFAULT_PATIENCE, MigrationReport
from stepstone.ops.model import BulkReport, HistoryPage, InstanceDetail, InstancePage, ReplayResult
from stepstone.scheduling import operations as scheduling
from stepstone.scheduling.operations import FlowLimits, ScheduleInfo, Schedules
from stepstone.scheduling.schedule import Schedule
from stepstone.store.caller_transaction import CallerTransactionStore
from stepstone.store.factory import open_ready_store
from stepstone.store.port import ClientStore, NewInstance, NewInstances
from stepstone.store.scheduling_port import SchedulingStore
from stepstone.store.settled import SettledWatch

SETTLED = TERMINAL | {FAILED, COMPENSATION_FAILED}
DEFAULT_START_BATCH = 1_000
"""Instances per statement of `start_many`: past about a thousand the rate hardly grows, while a
failing batch (a business key in use) takes more with it (docs/performance.md, "Batch starts")."""
MAX_START_BATCH = 10_000
START_BATCHES_IN_FLIGHT = 2
"""`start_many` sends two batches at a time, on two connections: a batch statement keeps one server
process busy, and two use both cores of a small server (12,000 -> 15,000-24,000 starts/s here)."""
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
    error: Any
    business_key: str | None
    created_at: datetime
    updated_at: datetime
    ended_at: datetime | None
    parent_id: str | None = None
    positions: list[dict[str, Any]] = field(default_factory=list)
    """The root ('') and every branch position: path, status, step, visit, wait, error."""
    children: list[dict[str, Any]] = field(default_factory=list)
    """Child instances this one started: id, definition_id, status, position."""

    @property
    def completed(self) -> bool:
        return self.status == COMPLETED


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


class Client(TaskOperations, MessageOperations):
    """Start and steer workflow instances, work on their human tasks and publish messages. Open with
    `await Client.connect(...)`."""

    def __init__(
        self, store: ClientStore, registry: Registry | None = None, *, limits: Limits | None = None,
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
    ) -> Client:
        """Connect to `database_url`, or to the configured (flags, environment, pyproject.toml) or
        embedded database. The schema must be migrated (`SchemaNotReady` otherwise), except on the
        embedded default, which is migrated here, saying so in one line on the log."""
        store = await open_ready_store(database_url, schema, settings=settings)
        return cls(store, registry, limits=limits, actor=actor)

    async def close(self) -> None:
        await self.detach()
        await self.store.close()

    async def detach(self) -> None:
        """Close what this client opened beside its store (the listener `wait_for` uses), leaving the
        store open: for a client made on a store its caller owns and closes."""
        await self._settled.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    # -- operations -----------------------------------------------------------------------------

    async def start(
        self,
        workflow: Workflow[Any] | str,
        input: Any = None,  # noqa: A002 - the instance's input
        *,
        idempotency_key: str | None = None,
        business_key: str | None = None,
        scope: str = DEFAULT_SCOPE,
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
        self._texts(scope=scope)
        wf = await self._selected(workflow, scope)
        self._texts(idempotency_key=idempotency_key, business_key=business_key)
        state, fingerprint = self._start_state(wf, input, business_key)
        await self._ensure_registered(wf)
        at, seconds = deadline_fields(wf.deadline if deadline is None else deadline)
        with tracing.span(f"stepstone.start {wf.id}", {"workflow": wf.id, "version": wf.version,
                                                       "business_key": business_key}) as span:
            new = NewInstance(
                id=new_instance_id(),
                pin=replace(pin_of(wf), scope=scope),
                state=state,
                start_step=wf.plan.start,
                business_key=business_key,
                idempotency_key=idempotency_key,
                fingerprint=fingerprint,
                actor=self.actor,
                deadline_at=at,
                deadline_seconds=seconds,
                start_deadline_seconds=wf.plan.start_deadline,
                context=durable.capture(),  # inside the span: the steps' spans are its children
            )
            if connection is not None:
                instance_id, _ = await self._caller_transaction().start_in(connection, new)
            else:
                instance_id, _ = await self.store.start(new)
            span.set_attribute("stepstone.instance_id", instance_id)
        return instance_id

    async def start_many(
        self,
        workflow: Workflow[Any] | str,
        inputs: Sequence[Any],
        *,
        idempotency_keys: Sequence[str | None] | None = None,
        business_keys: Sequence[str | None] | None = None,
        scope: str = DEFAULT_SCOPE,
        deadline: timedelta | float | datetime | None = None,
        batch_size: int = DEFAULT_START_BATCH,
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
        items = list(inputs)
        keys = _per_item("idempotency_keys", idempotency_keys, len(items))
        business = _per_item("business_keys", business_keys, len(items))
        if not 1 <= batch_size <= MAX_START_BATCH:
            raise InvalidInput(f"batch_size must be between 1 and {MAX_START_BATCH:,}, not {batch_size}",
                               what="batch size")
        held = [k for k in business if k is not None]
        if len(set(held)) != len(held):
            twice = next(k for k in held if held.count(k) > 1)
            raise InvalidInput(f"business key {twice!r} is given to more than one item", what="business keys")
        self._texts(scope=scope)
        wf = await self._selected(workflow, scope)
        for key, bkey in zip(keys, business, strict=True):
            self._texts(idempotency_key=key, business_key=bkey)
        prepared = []
        for n, (item, bkey) in enumerate(zip(items, business, strict=True), start=1):
            try:
                prepared.append(self._start_state(wf, item, bkey))
            except InvalidInput as exc:  # nothing was started: say which item, as a file's line
                raise type(exc)(f"item {n} of {len(items)}: {exc}", what=exc.what) from None
        await self._ensure_registered(wf)
        at, seconds = deadline_fields(wf.deadline if deadline is None else deadline)
        pin = replace(pin_of(wf), scope=scope)
        batches = [(lo, min(lo + batch_size, len(items))) for lo in range(0, len(items), batch_size)]
        results: list[list[str]] = [[] for _ in batches]
        done = 0
        with tracing.span(f"stepstone.start_many {wf.id}", {"workflow": wf.id, "version": wf.version,
                                                            "count": len(items)}):
            context = durable.capture()
            pending = iter(range(len(batches)))

            async def send() -> None:  # one of START_BATCHES_IN_FLIGHT senders, each on its own connection
                nonlocal done
                for n in pending:
                    lo, hi = batches[n]
                    started = await self.store.start_many(NewInstances(
                        pin=pin, start_step=wf.plan.start,
                        ids=[new_instance_id() for _ in range(lo, hi)],
                        states=[state for state, _ in prepared[lo:hi]],
                        business_keys=business[lo:hi], idempotency_keys=keys[lo:hi],
                        fingerprints=[fingerprint for _, fingerprint in prepared[lo:hi]],
                        actor=self.actor, deadline_at=at, deadline_seconds=seconds,
                        start_deadline_seconds=wf.plan.start_deadline, context=context,
                    ))
                    results[n] = [instance_id for instance_id, _ in started]
                    done += hi - lo
                    if on_batch is not None:
                        on_batch(done, len(items))

            senders = [asyncio.create_task(send()) for _ in range(min(START_BATCHES_IN_FLIGHT, len(batches)))]
            outcomes = await asyncio.gather(*senders, return_exceptions=True)  # let the others finish first
            failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
            if failed is not None:
                raise failed
        return [instance_id for batch in results for instance_id in batch]

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
                    return await self._caller_transaction().signal_in(
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
            positions=row["positions"], children=row["children"],
        )

    async def history(self, instance_id: str) -> list[dict[str, Any]]:
        """Every recorded event of the instance, oldest first."""
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
    ) -> list[dict[str, Any]]:
        """Instances newest first; pass the last row's (created_at, id) as `after` for the next page.
        `scope` keeps the instances of one scope key (tenant)."""
        self._texts(empty=True, status=status, workflow=definition, business_key=business_key,
                    after_id=after[1] if after else None, scope=scope)
        return await self.store.list(
            status=status, definition=definition, business_key=business_key, after=after, limit=limit, scope=scope,
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
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(settled.wait(), min(remaining, self._settled.fallback_seconds))
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

    # -- schedules and flow limits (docs/schedules.md) ----------------------------------------

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
        return await scheduling.list_schedules(self._scheduling(), name)

    async def pause_schedule(self, name: str) -> None:
        await scheduling.pause_schedule(self._scheduling(), name)

    async def resume_schedule(self, name: str) -> ScheduleInfo:
        """Resume from the next tick after now: ticks missed while paused do not fire."""
        return await scheduling.resume_schedule(self._scheduling(), name)

    async def delete_schedule(self, name: str) -> None:
        await scheduling.delete_schedule(self._scheduling(), name)

    async def trigger_schedule(self, name: str) -> str:
        """Start the schedule's workflow now, with its input, outside its ticks; returns the instance id."""
        info = (await scheduling.list_schedules(self._scheduling(), name))[0]
        return await self.start(info.workflow, info.input, idempotency_key=f"schedule:{name}:trigger:{uuid.uuid4()}")

    async def set_flow_limit(
        self, workflow: Workflow[Any] | str, *, max_running: int | None = None, key: str | None = None,
        min_interval: float | None = None,
    ) -> int:
        """At most `max_running` instances of the workflow run at once (per value of `key`: 'business_key' or a
        top-level state field), starts at least `min_interval` seconds apart; the rest wait as rows, in start
        order. Returns how many waiting instances the new limit admitted at once."""
        workflow_id = workflow if isinstance(workflow, str) else workflow.id
        self._text("workflow", workflow_id)
        return await scheduling.put_flow_limit(
            self._scheduling(), workflow_id, max_running=max_running, key=key, min_interval=min_interval,
        )

    async def remove_flow_limit(self, workflow: Workflow[Any] | str) -> int:
        """Remove the workflow's limit; returns how many waiting instances it released."""
        workflow_id = workflow if isinstance(workflow, str) else workflow.id
        return (await self._scheduling().delete_flow_limit(workflow_id))[1]

    async def flow_limits(self, workflow: str | None = None) -> FlowLimits:
        """The flow limits, with how many instances of each workflow run and wait now."""
        return await scheduling.flow_limits(self._scheduling(), workflow)

    # -- helpers --------------------------------------------------------------------------------

    async def _selected(self, workflow: Workflow[Any] | str, scope: str) -> Workflow[Any]:
        """The workflow a start runs: a `Workflow` as given, an id through the registry's selection."""
        if isinstance(workflow, Workflow):
            return workflow
        self._text("workflow", workflow)
        chosen = await self.store.definitions.select_version(scope, workflow)
        if chosen is None:
            return self._workflow(workflow)
        _, version, plan_hash = chosen
        found = self.registry.find(workflow, version, plan_hash)
        if found is None:
            raise DefinitionNotFound(workflow, version, reason=f"is the version scope {scope} selects, and this "
                                     "client's registry lacks it (or holds another structure under that version)")
        return found

    def _start_state(self, wf: Workflow[Any], input: Any, business_key: str | None) -> tuple[Any, str]:  # noqa: A002
        """A start's input checked and as the state model keeps it, and its idempotency fingerprint."""
        try:  # before the state model sees it: validating a 10,000-deep document is costly
            self.limits.check_depth("input", input)
        except PayloadRejected as exc:
            raise _typed(exc) from None
        state = wf.state_to_json({} if input is None else input)
        return state, _fingerprint(self._encode("input", state), business_key)

    def _caller_transaction(self) -> CallerTransactionStore:
        if not isinstance(self.store, CallerTransactionStore):
            raise TypeError(f"{type(self.store).__name__} cannot write in the caller's transaction")
        return self.store

    def _scheduling(self) -> SchedulingStore:
        if not isinstance(self.store, SchedulingStore):
            raise TypeError(f"{type(self.store).__name__} does not keep schedules or flow limits")
        return self.store

    def _workflow(self, workflow: Workflow[Any] | str) -> Workflow[Any]:
        if isinstance(workflow, Workflow):
            return workflow
        self._text("workflow", workflow)
        found = self.registry.latest(workflow)
        if found is None:
            raise DefinitionNotFound(workflow)
        return found

    async def _ensure_registered(self, wf: Workflow[Any], scope: str = DEFAULT_SCOPE) -> None:
        key = (scope, wf.id, wf.version)
        if key not in self._registered:
            await self.store.register(pin_of(wf, getattr(wf, "scope", DEFAULT_SCOPE)), wf.registration_document())
            self._registered.add(key)

    def _encode(self, what: str, value: Any) -> str:
        try:
            return self.limits.encode(what, value)
        except PayloadRejected as exc:
            raise _typed(exc) from None

    def _text(self, what: str, value: Any, *, free: bool = False, empty: bool = False) -> str:
        """The one check of a text argument (see `Limits.check_text`), as a typed InvalidInput."""
        try:
            return self.limits.check_text(what, value, free=free, empty=empty)
        except PayloadRejected as exc:
            raise _typed(exc) from None

    def _texts(self, *, empty: bool = False, **arguments: str | None) -> None:
        """Check each argument given (None means not given); the keyword names the argument.
        An empty id or filter is let through: it matches nothing, which the store then says."""
        for name, value in arguments.items():
            if value is not None:
                self._text(name.replace("_", " "), value, empty=empty)


def _typed(exc: PayloadRejected) -> InvalidInput:
    if exc.reason == "too_large":
        return PayloadTooLarge(str(exc), what=exc.what, reason=exc.reason)
    if exc.reason == "too_deep":
        return PayloadTooDeep(str(exc), what=exc.what, reason=exc.reason)
    return InvalidInput(str(exc), what=exc.what)


def _per_item(what: str, values: Sequence[str | None] | None, count: int) -> list[str | None]:
    if values is None:
        return [None] * count
    if isinstance(values, str) or len(values) != count:
        raise InvalidInput(f"{what} must be a list with one entry per input ({count}), None where there is none",
                           what=what.replace("_", " "))
    return list(values)


def _fingerprint(*parts: str | None) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()
