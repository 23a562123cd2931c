"""Which instants and durations can go to the database and come back, for the core and its callers.

PostgreSQL's timestamptz spans 4713 BC to 294276 AD, but the driver goes through Python's datetime,
which holds years 1 to 9999: it converts each instant to UTC to send it (an offset can move one that
looks in range out of it: `0001-01-01T00:00:00+00:01` is year 0 in UTC, an OverflowError), and it cannot
read back a row whose instant lies outside (a timer until year 10000 left its instance unreadable). A
duration long enough, or not a number, puts "that long from now" outside too.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

__all__ = ["MAX_DURATION", "MAX_SECONDS", "storable", "within_max"]

MAX_DURATION = timedelta(days=365_250)
"""A thousand years: longer than any deadline, delay, timeout, window or age, and short enough that that
long from now or ago is still an instant the driver holds."""
MAX_SECONDS = MAX_DURATION.total_seconds()


def storable(value: datetime) -> bool:
    """Whether the driver can send `value` and read it back (years 1 to 9999 in UTC; a naive one is read in
    the machine's zone, as the driver reads it)."""
    try:
        value.astimezone(UTC)
    except (OverflowError, ValueError):
        return False
    return True


def within_max(seconds: float) -> bool:
    """Whether `seconds` is at most MAX_SECONDS (False for NaN and infinity too)."""
    return seconds <= MAX_SECONDS
