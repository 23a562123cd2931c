"""Instants a caller hands in (filters, page cursors, deadlines), checked before a statement gets them:
one the driver cannot send or read back (`stepstone.core.timestamps`) is refused as bad input, with what was wrong,
instead of failing the statement with the driver's OverflowError.
"""

from __future__ import annotations

from datetime import datetime

from stepstone.core.timestamps import storable
from stepstone.errors import InvalidInput

__all__ = ["checked", "parse"]


def checked(value: datetime | None, what: str) -> datetime | None:
    """`value`, or InvalidInput naming `what` when the driver cannot hold it (years 1 to 9999 in UTC)."""
    if value is not None and not storable(value):
        raise InvalidInput(f"{what} {value.isoformat()} is outside the instants that can be stored "
                           "(years 1 to 9999 in UTC)", what=what)
    return value


def parse(text: str) -> datetime:
    """The instant of ISO 8601 `text` (a page cursor's); ValueError when it is none or the driver cannot hold it."""
    value = datetime.fromisoformat(text)
    if not storable(value):
        raise ValueError(f"{text} is outside the instants that can be stored")
    return value
