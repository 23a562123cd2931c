"""The store functions' outcome rows as results or typed errors, for the pool and the caller's connection."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stepstone.errors import (
    BusinessKeyInUse,
    IdempotencyConflict,
    InstanceNotFound,
    InvalidState,
    PositionNotFound,
    UnknownSignal,
)

__all__ = ["ended", "signal_command_id", "start_result"]


def ended(instance_id: str, status: str, business_key: str | None = None) -> InvalidState:
    """The refusal of a signal to an instance that has ended, in the same words on every path (a signal,
    and either path of start-or-signal, which names the business key it found the instance by)."""
    by_key = "" if business_key is None else f" with business key {business_key!r}"
    stays = "" if business_key is None else " (a business key stays with its instance)"
    return InvalidState(f"instance {instance_id}{by_key} is {status}; it takes no more signals{stays}",
                        instance_id=instance_id, status=status)


def signal_command_id(
    row: Mapping[str, Any], instance_id: str, name: str, dedup_key: str | None, position: str,
) -> int:
    """The command id of a recorded (or repeated) signal; a typed error for every other outcome."""
    outcome = row["outcome"]
    if outcome == "not_found":
        raise InstanceNotFound(instance_id)
    if outcome == "no_position":
        raise PositionNotFound(instance_id, position)
    if outcome == "unknown_signal":
        raise UnknownSignal(name, instance_id)
    if outcome == "ended":
        raise ended(instance_id, row["status"])
    if outcome == "conflict":
        raise IdempotencyConflict(
            f"dedup key {dedup_key!r} was already used on instance {instance_id} with a different signal",
            instance_id=instance_id,
            command_id=row["command_id"],
        )
    return int(row["command_id"])


def start_result(
    outcome: str, target: str, fingerprint: str | None, *, key: str | None, business_key: str | None,
    expected: str | None,
) -> tuple[str, bool]:
    """(instance id, created) of `start_in_caller_transaction`'s outcome."""
    if outcome == "business_key":
        raise BusinessKeyInUse(business_key or "", target)
    if outcome == "repeated":
        if fingerprint != expected:
            raise IdempotencyConflict(
                f"idempotency key {key!r} already started instance {target} with different input",
                instance_id=target,
            )
        return target, False
    return target, True
