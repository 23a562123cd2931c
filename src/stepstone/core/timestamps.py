"""What PostgreSQL's timestamps hold, for the instants and durations the core and its callers take.

A timestamptz (and the driver) holds years 1 to 9999 in UTC. An offset can move an instant that looks in
range out of it (`0001-01-01T00:00:00+00:01` is year 0 in UTC), and a duration long enough (or not a
number at all) puts "that long from now" out of it too; either failed the statement that stored it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

__all__ = ["MAX_DURATION", "MAX_SECONDS", "storable", "within_max"]

MAX_DURATION = timedelta(days=365_250)
"""A thousand years: longer than any deadline, delay, timeout, window or age, and short enough that that
long from now or ago is still an instant PostgreSQL holds."""
MAX_SECONDS = MAX_DURATION.total_seconds()


def storable(value: datetime) -> bool:
    """Whether a timestamptz holds `value` (a naive one read in the machine's zone, as the driver reads it)."""
    try:
        value.astimezone(UTC)
    except (OverflowError, ValueError):
        return False
    return True


def within_max(seconds: float) -> bool:
    """Whether `seconds` is at most MAX_SECONDS (False for NaN and infinity too)."""
    return seconds <= MAX_SECONDS
