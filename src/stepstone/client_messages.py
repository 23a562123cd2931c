"""Message correlation and signal-with-start on `Client`: `publish_message`, `start_or_signal`.

`MessageOperations` is a base of `Client`. A published message goes to the oldest open subscription
of its name and correlation key (or to every one, `correlate_all=True`); with none open it is
buffered for `ttl` seconds and delivered, first in first out, to the first matching subscription that
opens before then; without a TTL it is dropped. The answer always says which of these happened.
`message_id` deduplicates for as long as the message row is kept.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any, Literal

from stepstone.authoring.workflow import Workflow
from stepstone.client_base import ClientBase, deadline_fields
from stepstone.context import durable
from stepstone.core.pin import DEFAULT_SCOPE, pin_of
from stepstone.core.subscriptions import key_text
from stepstone.core.timestamps import MAX_SECONDS
from stepstone.errors import (
    BusinessKeyInUse,
    IdempotencyConflict,
    InstanceNotFound,
    InvalidInput,
    InvalidState,
    OpenSignalLimit,
    UnknownSignal,
)
from stepstone.ids import new_instance_id
from stepstone.store.outcomes import ended
from stepstone.store.port import NewInstance

__all__ = ["Delivery", "MessageOperations", "Published", "SignalledOrStarted"]

_LEAST_TTL = 1e-6  # the database keeps instants to the microsecond


@dataclass(frozen=True)
class Delivery:
    """Where a message went: the instance, its position and the MESSAGE command recorded there."""

    instance_id: str
    position: str
    command_id: int


@dataclass(frozen=True)
class Published:
    """What became of a published message: delivered (`deliveries`), buffered (until `expires_at`) or
    dropped; `duplicate` when the same message_id was published before (the earlier answer)."""

    outcome: Literal["delivered", "buffered", "dropped"]
    deliveries: list[Delivery] = field(default_factory=list)
    expires_at: datetime | None = None
    duplicate: bool = False


@dataclass(frozen=True)
class SignalledOrStarted:
    """`start_or_signal`: the instance signalled, whether this call started it, and the signal's command."""

    instance_id: str
    started: bool
    command_id: int


class MessageOperations(ClientBase):
    """The message half of `Client` (its attributes are set by `Client.__init__`)."""

    async def publish_message(
        self,
        name: str,
        correlation_key: str | bool | float,
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
        With `connection`, the message is written by the caller's own transaction (as `start`). A key that
        is not a string (a number, a boolean) is its JSON text (`true`, `42`), as a wait makes it of its state."""
        if not isinstance(correlation_key, str) and isinstance(correlation_key, bool | int | float):
            if not math.isfinite(correlation_key):
                raise InvalidInput(f"correlation key {correlation_key!r} has no JSON text", what="correlation key")
            correlation_key = key_text(correlation_key)
        for what, value in (("message name", name), ("correlation key", correlation_key)):
            self._text(what, value)
        if message_id is not None:
            self._text("message id", message_id)
        if ttl is not None and not 0 <= ttl <= MAX_SECONDS:  # inf once reached the server: "interval out of range"
            raise InvalidInput(f"ttl must be a number of seconds from 0 to a thousand years, got {ttl!r}", what="ttl")
        if ttl is not None and 0 < ttl < _LEAST_TTL:  # kept until now + 0 µs: answered buffered, never deliverable
            raise InvalidInput(f"ttl {ttl!r} is under a microsecond, the least a message is buffered for; give 0 "
                               "(or none) to drop it when no wait is open", what="ttl")
        self._encode("message payload", payload)
        fingerprint = hashlib.sha256(json.dumps([name, correlation_key, payload], sort_keys=True).encode()).hexdigest()
        publish = self.store.publish_message if connection is None else partial(
            self._caller_transaction(connection).publish_in, connection)
        row = await publish(name, correlation_key, payload, message_id=message_id, ttl=ttl,
                            correlate_all=correlate_all, fingerprint=fingerprint)
        if row["outcome"] == "conflict":
            raise IdempotencyConflict(f"message id {message_id!r} was already published with other content",
                                      instance_id="")
        if row["outcome"] == "full":
            cap = int(row["cap"])
            raise OpenSignalLimit(f"message {name!r} ({correlation_key!r}): {cap:,} messages are buffered for this "
                                  "name and key, as many as allowed; nothing was kept", instance_id=None, limit=cap)
        deliveries = [Delivery(str(d["instance_id"]), str(d["position"]), int(d["command_id"]))
                      for d in row["deliveries"] or []]
        status = str(row["status"]).lower()
        outcome: Literal["delivered", "buffered", "dropped"] = (
            "delivered" if status == "delivered" else "buffered" if status == "buffered" else "dropped")
        return Published(outcome, deliveries, row["expires_at"], duplicate=row["outcome"] == "duplicate")

    async def start_or_signal(
        self,
        workflow: Workflow[Any] | str,
        business_key: str,
        signal: str,
        payload: Any = None,
        *,
        input: Any = None,  # noqa: A002 - the instance's input, as in start
        dedup_key: str | None = None,
        scope: str = DEFAULT_SCOPE,
    ) -> SignalledOrStarted:
        """Signal the instance of `workflow` with `business_key`, starting it with `input` first when
        none has the key, in one transaction: two concurrent calls start one instance and both signal it.
        `input` is checked only when it is needed: an instance that has the key is signalled without it.
        A signal sent before the instance reaches a wait that takes it waits (parked) until it does.
        `scope` is the scope key (tenant) the business key belongs to, and the new instance's scope."""
        self._scope(scope)
        wf = self._workflow(workflow)
        self._text("business key", business_key)
        self._text("signal name", signal)
        if signal not in wf.plan.signal_names:
            raise UnknownSignal(signal, None, definition_id=wf.id, version=wf.version,
                                declared=tuple(sorted(wf.plan.signal_names)))
        signal_text = self._encode("signal payload", payload)
        signal_fingerprint = hashlib.sha256(json.dumps([signal, signal_text]).encode()).hexdigest()
        try:
            state = wf.state_to_json({} if input is None else input)
            self._encode("input", state)  # its limits: a start without a key needs no fingerprint of it
        except InvalidInput:
            # The input is the instance's only when this call starts it: one that has the key is signalled
            # without it (the same fingerprint, so a repeat through either path is the same signal).
            held = await self.store.list(definition=wf.id, business_key=business_key, scope=scope, limit=1,
                                         include_archived=True)  # an ended one answers as ended
            if not held:
                raise
            iid = str(held[0]["id"])
            try:
                command_id = await self.store.signal(iid, signal, payload, dedup_key=dedup_key,
                                                     fingerprint=signal_fingerprint, actor=self.actor,
                                                     context=durable.capture())
            except InvalidState as exc:  # ended: said as the other path says it, by its business key
                raise ended(iid, str(exc.status), business_key) from None
            # A repeat of a call that started the instance (its dedup key) says so, as the other path does
            started = dedup_key is not None and await self.store.signal_started_instance(iid, dedup_key)
            return SignalledOrStarted(iid, started, command_id)
        await self._ensure_registered(wf)
        at, seconds = deadline_fields(wf.deadline)  # a started instance gets its deadlines as a start gives them
        new = NewInstance(
            id=new_instance_id(), pin=pin_of(wf, scope), state=state, start_step=wf.plan.start,
            business_key=business_key,
            idempotency_key=None, fingerprint=None,
            actor=self.actor, deadline_at=at, deadline_seconds=seconds, start_deadline_seconds=wf.plan.start_deadline,
            context=durable.capture(),
        )
        row = await self.store.start_or_signal(new, signal, payload, dedup_key=dedup_key,
                                               signal_fingerprint=signal_fingerprint)
        iid, outcome = str(row["instance_id"]), row["outcome"]
        if outcome in ("recorded", "duplicate"):
            return SignalledOrStarted(iid, bool(row["started"]), int(row["command_id"]))
        if outcome == "ended":
            raise ended(iid, str(row["status"]), business_key)
        if outcome == "conflict":
            raise IdempotencyConflict(f"dedup key {dedup_key!r} was already used on instance {iid} with another "
                                      "signal", instance_id=iid, command_id=row["command_id"])
        if outcome == "unknown_signal":
            raise UnknownSignal(signal, iid)
        if outcome == "not_found":
            raise InstanceNotFound(iid)
        raise BusinessKeyInUse(business_key, iid)

