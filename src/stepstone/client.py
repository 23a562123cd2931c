"""Public operations on workflow instances: start, signal, cancel, retry, inspect, wait.

`Client` is async; `SyncClient` (`stepstone/_sync_client.py`) is generated from it by
`python -m stepstone._gen_sync`, never kept by hand. The CLI and the HTTP API call these same methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from stepstone.authoring.workflow import Registry, Workflow
from stepstone.config import Settings
from stepstone.core.limits import Limits, PayloadRejected
from stepstone.core.model import COMPLETED, FAILED, TERMINAL
from stepstone.core.pin import DEFAULT_SCOPE, pin_of
from stepstone.errors import DefinitionNotFound, InvalidInput, PayloadTooDeep, PayloadTooLarge, WaitTimeout
from stepstone.store.factory import open_ready_store
from stepstone.store.port import ClientStore, NewInstance
from stepstone.store.settled import SettledWatch

SETTLED = TERMINAL | {FAILED}
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


class Client:
    """Start and steer workflow instances. Open with `await Client.connect(...)`."""

    def __init__(
        self, store: ClientStore, registry: Registry | None = None, *, limits: Limits | None = None,
        actor: str | None = None,
    ) -> None:
        self.store = store
        self.registry = registry or Registry()
        self.limits = limits or Limits()
        self.actor = None if actor is None else self._text("actor", actor)
        self._registered: set[tuple[str, str, int]] = set()
        self._settled = SettledWatch(store)

    @classmethod
    async def connect(
        cls,
        database_url: str | None = None,
        *,
        schema: str | None = None,
        registry: Registry | None = None,
        settings: Settings | None = None,
        limits: Limits | None = None,
        actor: str | None = None,
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
    ) -> str:
        """Start an instance; returns its id. The same key with the same input returns the
        same instance; the same key with other input raises IdempotencyConflict. `scope` is the
        tenant the instance belongs to (the management API's tokens are granted per scope)."""
        wf = self._workflow(workflow)
        self._texts(idempotency_key=idempotency_key, business_key=business_key, scope=scope)
        try:  # before the state model sees it: validating a 10,000-deep document is costly
            self.limits.check_depth("input", input)
        except PayloadRejected as exc:
            raise _typed(exc) from None
        state = wf.state_to_json({} if input is None else input)
        text = self._encode("input", state)
        await self._ensure_registered(wf, scope)
        new = NewInstance(
            id=str(uuid.uuid4()),
            pin=pin_of(wf, scope),
            state=state,
            start_step=wf.plan.start,
            business_key=business_key,
            idempotency_key=idempotency_key,
            fingerprint=_fingerprint(text, business_key),
            actor=self.actor,
        )
        instance_id, _ = await self.store.start(new)
        return instance_id

    async def signal(
        self, instance_id: str, name: str, payload: Any = None, *, dedup_key: str | None = None, position: str = "",
    ) -> int:
        """Send a signal; returns its command id. A repeated dedup key applies once. `position` addresses
        one branch (its path, e.g. ``ship/2``); the default is the instance's root position."""
        self._texts(empty=True, instance_id=instance_id)
        self._texts(signal_name=name, dedup_key=dedup_key, position=position or None)
        text = self._encode("signal payload", payload)
        fingerprint = _fingerprint(name, position, text) if position else _fingerprint(name, text)
        return await self.store.signal(
            instance_id, name, payload, dedup_key=dedup_key, fingerprint=fingerprint, actor=self.actor,
            position=position,
        )

    async def cancel(self, instance_id: str, reason: str = "") -> str:
        """Cancel an instance (idempotent); returns its status afterwards."""
        self._texts(empty=True, instance_id=instance_id)
        self._text("cancel reason", reason, free=True, empty=True)
        return await self.store.cancel(instance_id, reason, self.actor)

    async def retry(self, instance_id: str) -> None:
        """Re-drive the failed step of a FAILED instance."""
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
    ) -> list[dict[str, Any]]:
        """Instances newest first; pass the last row's (created_at, id) as `after` for the next page."""
        self._texts(empty=True, status=status, workflow=definition, business_key=business_key,
                    after_id=after[1] if after else None)
        return await self.store.list(
            status=status, definition=definition, business_key=business_key, after=after, limit=limit
        )

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

    # -- helpers --------------------------------------------------------------------------------

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
            await self.store.register(pin_of(wf, scope), wf.plan.document())
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


def _fingerprint(*parts: str | None) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()
