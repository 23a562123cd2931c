"""JSON text of the engine's documents: orjson, and the standard encoder for what orjson refuses (an
integer beyond 64 bits). orjson encodes a commit group about 5x faster than `json.dumps` (19 vs 95 µs for
four three-step commit documents), and a step's patch is measured on every commit. NaN never reaches the
store's encoder: `Limits.encode` refuses it first.

Decoding is orjson's too, where it reads what `json.loads` reads: it reads an integer beyond 64 bits as a
float, so a text with 19 digits in a row (every integer from 10**18 up has them) goes to `json.loads`, and
so does a text orjson refuses (NaN, an unpaired surrogate, a number beyond a double). The run is found
with `bytes.translate` and `find`, a few µs for 16 KB; a regular expression cost as much as orjson saved.
For a map's state of 16 KB: 77 against 352 µs a decode; for 100 bytes, 0.55 against 1.3 µs
(docs/performance-history.md, "Large states: decoded by orjson, compared in C").
"""

from __future__ import annotations

import json
from typing import Any

import orjson

__all__ = ["dumps", "loads", "parse", "size"]


def dumps(value: Any) -> str:
    """Compact JSON text of `value`; non-string keys become strings, as with the standard encoder."""
    return _encoded(value).decode()


_DIGITS_AS_ZERO = bytes.maketrans(b"0123456789", b"0" * 10)
_LONG_NUMBER = b"0" * 19


def loads(text: str | bytes) -> Any:
    """The document of JSON `text`, exactly as `json.loads` reads it."""
    try:
        data = text.encode() if isinstance(text, str) else text
        if data.translate(_DIGITS_AS_ZERO).find(_LONG_NUMBER) < 0:
            return orjson.loads(data)
    except (UnicodeEncodeError, orjson.JSONDecodeError):  # json.loads reads what orjson refuses
        pass
    return json.loads(text)


def parse(text: str | bytes) -> Any:
    """The document of JSON `text` that a person or a client gave (a form, a flag, a request body, a
    cursor): `json.loads`, with a document nested past what the parser takes reported as the
    `json.JSONDecodeError` every caller already handles, not the RecursionError that escaped them."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text if isinstance(text, str) else "", 0) from None


def size(value: Any) -> int:
    """Bytes of `value`'s compact JSON text (UTF-8)."""
    return len(_encoded(value))


def _encoded(value: Any) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:  # an integer beyond 64 bits
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
