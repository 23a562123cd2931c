"""Page cursors: opaque URL-safe base64 of a small JSON array, the last row's key, decoded in one place.

Every list that pages (the API's, the task inbox of the client, `stepstone list --after`) decodes its
cursor with `decode` and a field per key value, so each refuses the same things the same way, as
InvalidInput naming the parameter: text that is not base64 JSON of the right length, a number past
its column (an int4 priority, sequence number or version; an int8 id), a number that is a float or a
bool, an instant without a timezone or outside what the driver holds, an id that is not a UUID, text
holding NUL. A value the driver cannot send would otherwise fail the statement (a 500 over HTTP).
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

from stepstone import instants
from stepstone.core import json_text
from stepstone.core.limits import MAX_INT4, MAX_INT8
from stepstone.errors import InvalidInput

__all__ = ["ID", "INSTANT", "INT4", "INT4_KEY", "TEXT", "UUID", "Field", "decode", "encode", "integer"]

Field = Callable[[Any], Any]
"""One value of a cursor's key, checked: returns it as the statement takes it, or raises ValueError
(TypeError for a value of the wrong JSON type)."""


def integer(low: int, high: int) -> Field:
    """An integer from `low` to `high` (a JSON float or a bool is not one)."""
    def check(value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError("not an integer")
        if not low <= value <= high:
            raise ValueError(f"not an integer from {low} to {high}")
        return value
    return check


INT4 = integer(-MAX_INT4 - 1, MAX_INT4)
"""A value of an integer column (a task's priority)."""
INT4_KEY = integer(0, MAX_INT4)
"""A non-negative integer key (a history sequence number, a definition's version)."""
ID = integer(0, MAX_INT8)
"""A bigint id (a command's, an outbox event's)."""


def INSTANT(value: Any) -> datetime:  # noqa: N802 - a field, named like the others
    """An ISO 8601 instant with a timezone that the driver can hold (years 1 to 9999 in UTC)."""
    if not isinstance(value, str):
        raise TypeError("not an instant")
    if datetime.fromisoformat(value).tzinfo is None:
        raise ValueError("an instant without a timezone")
    return instants.parse(value)


def UUID(value: Any) -> str:  # noqa: N802 - a field, named like the others
    """A UUID, canonical."""
    if not isinstance(value, str):
        raise TypeError("not a UUID")
    return str(uuid.UUID(value))


def TEXT(value: Any) -> str:  # noqa: N802 - a field, named like the others
    """A string PostgreSQL text can hold (no NUL)."""
    if not isinstance(value, str):
        raise TypeError("not a name")
    if "\x00" in value:
        raise ValueError("a name holding NUL")
    return value


def encode(*key: Any) -> str:
    """The cursor of the row whose key is `key` (values JSON has no type for, as `str` writes them)."""
    raw = json.dumps(list(key), separators=(",", ":"), default=str).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode(cursor: str, *fields: Field, what: str = "cursor") -> tuple[Any, ...]:
    """The key inside `cursor`, one value per field, each checked by its field; InvalidInput naming
    `what` (the parameter that carried it) when it is not a cursor stepstone made."""
    refused = InvalidInput(f"{what} {cursor[:80]!r} is not a page cursor stepstone returned for this list",
                           what=what)
    try:
        key = json_text.parse(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError):
        raise refused from None
    if not isinstance(key, list) or len(key) != len(fields):
        raise refused
    try:
        return tuple(field(value) for field, value in zip(fields, key, strict=True))
    except (TypeError, ValueError):
        raise refused from None
