"""Keyset pagination: opaque cursors that carry the last row's key, never an offset.

A page is ``{"items": [...], "next_cursor": "..." | null}``; pass ``cursor`` back for the rows after it.
A cursor is URL-safe base64 of a small JSON array; one that does not decode is InvalidInput (422).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from stepstone.core import json_text
from stepstone.core.limits import MAX_INT8
from stepstone.errors import InvalidInput

__all__ = ["DEFAULT_LIMIT", "MAX_BIGINT", "MAX_LIMIT", "decode_cursor", "decode_id_cursor", "encode_cursor", "page"]

DEFAULT_LIMIT = 50
MAX_LIMIT = 500
MAX_BIGINT = MAX_INT8


def encode_cursor(*key: Any) -> str:
    raw = json.dumps(list(key), separators=(",", ":"), default=str).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, arity: int) -> list[Any]:
    """The key inside `cursor` (a list of `arity` values); InvalidInput when it is not one of ours."""
    try:
        key = json_text.parse(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        key = None
    if not isinstance(key, list) or len(key) != arity:
        raise InvalidInput(f"cursor {cursor[:80]!r} is not a cursor this API returned", what="cursor")
    return key


def decode_id_cursor(cursor: str | None) -> int:
    """The id (or sequence number) inside a cursor of one integer; 0 without a cursor."""
    if not cursor:
        return 0
    value = decode_cursor(cursor, 1)[0]
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_BIGINT:
        raise InvalidInput(f"cursor {cursor[:80]!r} is not a cursor this API returned", what="cursor")
    return value


def page(rows: list[dict[str, Any]], limit: int, key: Any) -> dict[str, Any]:
    """The first `limit` of `rows` (fetched with limit + 1) and the cursor of the next page, if any."""
    items = rows[:limit]
    more = len(rows) > limit
    return {"items": items, "next_cursor": encode_cursor(*key(items[-1])) if more and items else None}
