"""Instants and durations a caller hands in (filters, cursors, deadlines), checked before a statement gets them.

PostgreSQL's timestamptz and the driver hold years 1 to 9999 in UTC. An offset can move an instant that
looks in range out of it (`0001-01-01T00:00:00+00:01` is year 0 in UTC), and the driver then fails the
statement with an OverflowError: refused here as bad input instead, with what was wrong.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from stepstone.errors import InvalidInput

__all__ = ["MAX_DURATION", "checked", "parse", "storable"]

MAX_DURATION = timedelta(days=365_250)
"""A thousand years: longer than any deadline, window or age, and short enough that that long from now or
ago is still an instant PostgreSQL holds."""


def storable(value: datetime) -> bool:
    """Whether a timestamptz holds `value` (a naive one read in the machine's zone, as the driver reads it)."""
    try:
        value.astimezone(UTC)
    except (OverflowError, ValueError):
        return False
    return True


def checked(value: datetime | None, what: str) -> datetime | None:
    """`value`, or InvalidInput naming `what` when no timestamptz holds it."""
    if value is not None and not storable(value):
        raise InvalidInput(f"{what} {value.isoformat()} is outside the instants that can be stored "
                           "(years 1 to 9999 in UTC)", what=what)
    return value


def parse(text: str) -> datetime:
    """The instant of ISO 8601 `text` (a page cursor's); ValueError when it is none or no timestamptz holds it."""
    value = datetime.fromisoformat(text)
    if not storable(value):
        raise ValueError(f"{text} is outside the instants that can be stored")
    return value
