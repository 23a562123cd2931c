"""What a service's settings may hold (a worker's, an outbox relay's, the payload limits), checked when
the settings are made: a worker with a lease no timestamp can hold started, then failed claim after claim
with "interval out of range"; now it is not made. Durations are seconds above zero (or from zero) up to
the thousand years every duration stepstone stores is held to (`core.timestamps`); counts are whole
numbers within what their column or the machine can take."""

from __future__ import annotations

import math
from typing import Any

from stepstone.core.timestamps import MAX_SECONDS
from stepstone.errors import ConfigError

__all__ = ["MAX_BATCH", "check_count", "check_seconds", "is_whole"]

MAX_BATCH = 100_000
"""Rows one batch of a sweep, a bulk repair or the outbox relay takes at most."""


def check_seconds(owner: str, what: str, value: Any, *, zero: bool = False) -> None:
    """`value` is a number of seconds above zero (from zero with `zero`) and at most a thousand years."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    low_ok = number and (value >= 0 if zero else value > 0)
    if not (number and low_ok and math.isfinite(value) and value <= MAX_SECONDS):
        low = "from 0" if zero else "above 0"
        raise ConfigError(f"{owner}: {what} must be a number of seconds {low} and at most a thousand years, "
                          f"got {value!r}")


def is_whole(value: Any, low: int, high: int) -> bool:
    """`value` is a whole number (not a bool) from `low` to `high`."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def check_count(owner: str, what: str, value: Any, low: int, high: int) -> None:
    """`value` is a whole number from `low` to `high`."""
    if not is_whole(value, low, high):
        raise ConfigError(f"{owner}: {what} must be a whole number from {low:,} to {high:,}, got {value!r}")
