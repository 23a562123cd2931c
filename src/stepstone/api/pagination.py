"""Keyset pagination: opaque cursors that carry the last row's key, never an offset.

A page is ``{"items": [...], "next_cursor": "..." | null}``; pass ``cursor`` back for the rows after it.
A cursor is URL-safe base64 of a small JSON array (`stepstone.cursors`); one that does not decode, or
holds a value its column cannot, is InvalidInput (422).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stepstone import cursors
from stepstone.core.limits import MAX_INT8

__all__ = ["DEFAULT_LIMIT", "MAX_BIGINT", "MAX_LIMIT", "decode_cursor", "decode_id_cursor", "encode_cursor", "page"]

DEFAULT_LIMIT = 50
MAX_LIMIT = 500
MAX_BIGINT = MAX_INT8

encode_cursor = cursors.encode


def decode_cursor(cursor: str, *fields: cursors.Field) -> tuple[Any, ...]:
    """The key inside the `cursor` query parameter, one value per field; InvalidInput when it is not ours."""
    return cursors.decode(cursor, *fields, what="cursor")


def decode_id_cursor(cursor: str | None, field: cursors.Field = cursors.ID) -> int:
    """The id (or, with `cursors.INT4_KEY`, the sequence number) inside a cursor of one integer; 0 without one."""
    if not cursor:
        return 0
    value: int = decode_cursor(cursor, field)[0]
    return value


def page(rows: list[dict[str, Any]], limit: int, key: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """The first `limit` of `rows` (fetched with limit + 1) and the cursor of the next page, if any."""
    items = rows[:limit]
    more = len(rows) > limit
    return {"items": items, "next_cursor": encode_cursor(*key(items[-1])) if more and items else None}
