"""What the parts of `Client` share: its store, registry, limits and actor (`ClientBase`), and the helpers
several parts need: the checks of text and JSON arguments with their typed errors, registering a definition
before it runs, the workflow a name stands for, the caller's transaction, fingerprints and deadlines.

`ClientBase` is a base of the starts, schedules and messages parts and so of `Client`, whose `__init__` sets
the attributes declared here.
"""

from __future__ import annotations

import hashlib
import json
import numbers
from datetime import datetime, timedelta
from typing import Any

from stepstone import instants
from stepstone._sync_loop import on_sync_loop
from stepstone.authoring.registration import recorded_fields
from stepstone.authoring.workflow import Registry, Workflow
from stepstone.core.limits import Limits, PayloadRejected
from stepstone.core.pin import DEFAULT_SCOPE, check_scope, pin_of
from stepstone.core.timestamps import MAX_SECONDS
from stepstone.errors import DefinitionNotFound, InvalidInput, refused
from stepstone.store.caller_transaction import ASYNC_DRIVERS, CallerTransactionStore, driver_of
from stepstone.store.port import ClientStore


class ClientBase:
    """The attributes and helpers of `Client` its parts use (the attributes are set by `Client.__init__`)."""

    store: ClientStore
    registry: Registry
    limits: Limits
    actor: str | None
    _registered: set[tuple[str, str, int]]
    _registry_named = "this client's registry"
    """How a refusal names `registry`: the CLI and the API name what their user gave (`--app`)."""

    def _caller_transaction(self, connection: Any) -> CallerTransactionStore:
        if not isinstance(self.store, CallerTransactionStore):
            raise TypeError(f"{type(self.store).__name__} cannot write in the caller's transaction")
        if driver_of(connection) in ASYNC_DRIVERS and on_sync_loop():
            # The connection's own loop is blocked in the SyncClient call: used from our loop thread, an asyncpg
            # one fails half-way and leaves the caller's transaction unusable.
            raise InvalidInput(
                "connection= of a SyncClient takes a sync connection (psycopg Connection, SQLAlchemy Session or "
                "Connection): an async one belongs to an event loop, which waits for this call and whose "
                "connection would be left unusable; use Client on that loop", what="connection")
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
            await self.store.register(pin_of(wf, getattr(wf, "scope", DEFAULT_SCOPE)), wf.registration_document(),
                                      **recorded_fields(wf))
            self._registered.add(key)

    def _encode(self, what: str, value: Any) -> str:
        try:
            return self.limits.encode(what, value)
        except PayloadRejected as exc:
            raise refused(exc) from None

    def _text(self, what: str, value: Any, *, free: bool = False, empty: bool = False) -> str:
        """The one check of a text argument (see `Limits.check_text`), as a typed InvalidInput."""
        try:
            return self.limits.check_text(what, value, free=free, empty=empty)
        except PayloadRejected as exc:
            raise refused(exc) from None

    def _scope(self, scope: str) -> str:
        """The scope an instance is started in: a text (`_text`), then a scope name (`check_scope`)."""
        return check_scope(self._text("scope", scope))

    def _texts(self, *, empty: bool = False, **arguments: str | None) -> None:
        """Check each argument given (None means not given); the keyword names the argument.
        An empty id or filter is let through: it matches nothing, which the store then says."""
        try:
            self.limits.check_texts(arguments, empty=empty)
        except PayloadRejected as exc:
            raise refused(exc) from None



def _fingerprint(*parts: str | None) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def deadline_fields(value: timedelta | float | datetime | None) -> tuple[datetime | None, float | None]:
    """(instant, seconds from now): a deadline as the store takes it (a start's, a signal-with-start's)."""
    if value is None:
        return None, None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise InvalidInput("deadline must be an instant with a time zone", what="deadline")
        return instants.checked(value, "deadline"), None
    if isinstance(value, bool) or not isinstance(value, timedelta | numbers.Real):
        raise InvalidInput(f"deadline is seconds (a number), a timedelta or an aware datetime, got {value!r}",
                           what="deadline")
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds != seconds:  # noqa: PLR0124 - NaN
        raise InvalidInput("deadline must be a number of seconds, got nan", what="deadline")
    if seconds < 0:
        raise InvalidInput(f"deadline must not be negative, got {seconds} s", what="deadline")
    if seconds > MAX_SECONDS:  # inf too
        raise InvalidInput(f"deadline must be at most a thousand years from now, got {seconds} s", what="deadline")
    return None, seconds
