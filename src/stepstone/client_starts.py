"""Starting instances on `Client`: `start` (one instance, or in the caller's transaction) and `start_many`
(batches of one statement each, two in flight).

`StartOperations` is a base of `Client` (through `client_schedules.ScheduleOperations`, whose trigger is a
start). A workflow named by id runs the version its scope selects; an idempotency key given again with the
same input returns the instance it started, and a business key belongs to one instance.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from stepstone.authoring.selection import selected_workflow
from stepstone.authoring.workflow import Workflow
from stepstone.client_base import ClientBase, _fingerprint, deadline_fields
from stepstone.context import durable
from stepstone.core.limits import PayloadRejected
from stepstone.core.pin import DEFAULT_SCOPE, pin_of
from stepstone.errors import InvalidInput, refused
from stepstone.ids import new_instance_id
from stepstone.observability import tracing
from stepstone.store.port import NewInstance, NewInstances

__all__ = ["DEFAULT_START_BATCH", "MAX_START_BATCH", "START_BATCHES_IN_FLIGHT", "StartOperations"]

DEFAULT_START_BATCH = 1_000
"""Instances per statement of `start_many`: past about a thousand the rate hardly grows, while a
failing batch (a business key in use) takes more with it (docs/performance-history.md, "Batch starts")."""
MAX_START_BATCH = 10_000
START_BATCHES_IN_FLIGHT = 2
"""`start_many` sends two batches at a time, on two connections: a batch statement keeps one server
process busy, and two use both cores of a small server (12,000 -> 15,000-24,000 starts/s here)."""


class StartOperations(ClientBase):
    """The starts of `Client` (its attributes are set by `Client.__init__`)."""

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
        self._scope(scope)
        wf = await self._selected(workflow, scope)
        self._texts(idempotency_key=idempotency_key, business_key=business_key)
        state, fingerprint = self._start_state(wf, input, business_key, keyed=idempotency_key is not None)
        await self._ensure_registered(wf)
        at, seconds = deadline_fields(wf.deadline if deadline is None else deadline)
        with tracing.span(f"stepstone.start {wf.id}", {"workflow": wf.id, "version": wf.version,
                                                       "business_key": business_key}) as span:
            new = NewInstance(
                id=new_instance_id(),
                pin=pin_of(wf, scope),
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
                instance_id, _ = await self._caller_transaction(connection).start_in(connection, new)
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
        self._scope(scope)
        wf = await self._selected(workflow, scope)
        for key, bkey in zip(keys, business, strict=True):
            self._texts(idempotency_key=key, business_key=bkey)
        prepared = []
        for n, (item, bkey, key) in enumerate(zip(items, business, keys, strict=True), start=1):
            try:
                prepared.append(self._start_state(wf, item, bkey, keyed=key is not None))
            except InvalidInput as exc:  # nothing was started: say which item, as a file's line
                raise exc.in_batch(n, len(items)) from None
        await self._ensure_registered(wf)
        at, seconds = deadline_fields(wf.deadline if deadline is None else deadline)
        pin = pin_of(wf, scope)
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
                    if on_started is not None:
                        on_started(lo, results[n])
                    if on_batch is not None:
                        on_batch(done, len(items))

            senders = [asyncio.create_task(send()) for _ in range(min(START_BATCHES_IN_FLIGHT, len(batches)))]
            outcomes = await asyncio.gather(*senders, return_exceptions=True)  # let the others finish first
            failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
            if failed is not None:
                raise failed
        return [instance_id for batch in results for instance_id in batch]

    # -- helpers --------------------------------------------------------------------------------

    async def _selected(self, workflow: Workflow[Any] | str, scope: str) -> Workflow[Any]:
        """The workflow a start runs: a `Workflow` as given, an id through the registry's selection."""
        if isinstance(workflow, Workflow):
            return workflow
        self._text("workflow", workflow)
        found = await selected_workflow(self.store.definitions, self.registry, workflow, scope,
                                        holder=self._registry_named)
        return self._workflow(workflow) if found is None else found

    def _start_state(self, wf: Workflow[Any], input: Any, business_key: str | None,  # noqa: A002
                     *, keyed: bool) -> tuple[Any, str | None]:
        """A start's input checked and as the state model keeps it, and its idempotency fingerprint when
        the start is `keyed` (the fingerprint was a sixth of a batched start's CPU in the client: 32 -> 27 µs)."""
        try:  # before the state model sees it: validating a 10,000-deep document is costly
            self.limits.check_depth("input", input)
        except PayloadRejected as exc:
            raise refused(exc) from None
        state = wf.state_to_json({} if input is None else input)
        text = self._encode("input", state)  # the limits, whether or not a fingerprint is made of it
        return state, _fingerprint(text, business_key) if keyed else None


def _per_item(what: str, values: Sequence[str | None] | None, count: int) -> list[str | None]:
    if values is None:
        return [None] * count
    if isinstance(values, str) or len(values) != count:
        raise InvalidInput(f"{what} must be a list with one entry per input ({count}), None where there is none",
                           what=what.replace("_", " "))
    return list(values)
