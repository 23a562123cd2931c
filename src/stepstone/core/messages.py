"""Correlated messages in the core: subscribing when a wait is entered, and a delivered message.

A wait that takes messages subscribes to each name with the correlation key read from the state
(`core.subscriptions`); the store delivers a published message to the oldest open subscription as a MESSAGE
command of that position and visit, which moves the position like a signal would.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from stepstone.core.effects import CloseTimers, RecordHistory
from stepstone.core.entering import enter, settled
from stepstone.core.leaving_waits import LATE, within_deadline
from stepstone.core.model import WAITING, CommandView, Decision, InstanceView, Settle
from stepstone.core.plan import Plan

JSON = Any


def signal_cause(kind: str, name: str, payload: JSON) -> dict[str, Any]:
    """What a step entered by a SIGNAL or a correlated MESSAGE command is given as `ctx.signal`, from the
    command's `payload` (a signal's as sent; a message's command holds the message, its payload inside).
    A step run again, by a retry or a replay, is given it again."""
    body = payload.get("payload") if kind == "MESSAGE" and isinstance(payload, dict) else payload
    return {"signal": {"name": name, "payload": body}}


def message_received(instance: InstanceView, command: CommandView, plan: Plan, now: datetime) -> Decision:
    """A message delivered to this position: taken by the wait it was correlated to; otherwise returned (the
    store's trigger on the STALE settle hands it on to the next wait of its key, else the buffer), whether the
    wait took it from the buffer (`buffered`) or it was published to the wait (`goes_on`). A copy of a message
    published to every open wait (correlate_all) is parked."""
    wait = instance.wait or {}
    name = command.name or ""
    accepted = wait.get("messages") or {}
    waiting = (instance.position_status or instance.status) == WAITING
    body = command.payload if isinstance(command.payload, dict) else {}
    goes_on = body.get("buffered") or body.get("goes_on")
    left = Settle("STALE", "WAIT_LEFT") if goes_on else Settle("PARKED", "NOT_WAITING")
    if not waiting or name not in accepted or command.visit != instance.visit:
        data = {"message": name, "command": command.id}
        kind = "MESSAGE_RETURNED" if left.state == "STALE" else "MESSAGE_PARKED"
        return Decision(left, (RecordHistory(kind, instance.step, instance.visit, data),))
    received = RecordHistory("MESSAGE_CORRELATED", instance.step, instance.visit,
                             {"message": name, "command": command.id, "message_id": body.get("message_id"),
                              "correlation_key": body.get("correlation_key")})
    cause = signal_cause("MESSAGE", name, command.payload)
    entered = enter(instance, plan, accepted[name], instance.state, now, cause=cause)
    late = Settle(left.state, LATE)
    parked = RecordHistory("MESSAGE_RETURNED" if late.state == "STALE" else "MESSAGE_PARKED", instance.step,
                           instance.visit, {"message": name, "command": command.id, "reason": LATE})
    return within_deadline(instance, plan, Decision(settled(entered), (received, CloseTimers(), *entered)),
                           late, parked)
