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
    """A message delivered to this position: taken by the wait it was correlated to, parked otherwise."""
    wait = instance.wait or {}
    name = command.name or ""
    accepted = wait.get("messages") or {}
    waiting = (instance.position_status or instance.status) == WAITING
    if not waiting or name not in accepted or command.visit != instance.visit:
        data = {"message": name, "command": command.id}
        return Decision(Settle("PARKED", "NOT_WAITING"),
                        (RecordHistory("MESSAGE_PARKED", instance.step, instance.visit, data),))
    body = command.payload if isinstance(command.payload, dict) else {}
    received = RecordHistory("MESSAGE_CORRELATED", instance.step, instance.visit,
                             {"message": name, "command": command.id, "message_id": body.get("message_id"),
                              "correlation_key": body.get("correlation_key")})
    cause = signal_cause("MESSAGE", name, command.payload)
    entered = enter(instance, plan, accepted[name], instance.state, now, cause=cause)
    parked = RecordHistory("MESSAGE_PARKED", instance.step, instance.visit,
                           {"message": name, "command": command.id, "reason": LATE})
    return within_deadline(instance, plan, Decision(settled(entered), (received, CloseTimers(), *entered)),
                           Settle("PARKED", LATE), parked)
