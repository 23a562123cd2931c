"""JSON text of the engine's documents: orjson, and the standard encoder for what orjson refuses (an
integer beyond 64 bits). orjson encodes a commit group about 5x faster than `json.dumps` (19 vs 95 µs for
four three-step commit documents), and a step's patch is measured on every commit. NaN never reaches the
store's encoder: `Limits.encode` refuses it first.

Decoding stays with `json.loads`: orjson reads an integer beyond 64 bits as a float, and a guard that
finds such integers in the text (a search for 19 digits in a row) cost as much as orjson saved; msgspec
reads them exactly and 6x faster, but a step commit decodes 1.7 documents, 6-9 µs of the engine's
CPU a step: not worth another dependency (docs/performance.md, "Not done yet").
"""

from __future__ import annotations

import json
from typing import Any

import orjson

__all__ = ["dumps", "size"]


def dumps(value: Any) -> str:
    """Compact JSON text of `value`; non-string keys become strings, as with the standard encoder."""
    return _encoded(value).decode()


def size(value: Any) -> int:
    """Bytes of `value`'s compact JSON text (UTF-8)."""
    return len(_encoded(value))


def _encoded(value: Any) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:  # an integer beyond 64 bits
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
