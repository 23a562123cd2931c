"""The engine's JSON text (stepstone.core.json_text, the store's json/jsonb codec): orjson, the standard
encoder as fallback, writes what the standard encoder wrote, including what orjson alone refuses; and
reads what `json.loads` reads, including what orjson alone reads otherwise (an integer beyond 64 bits) or
refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from stepstone.core.json_text import dumps, loads, size


def _standard(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@pytest.mark.parametrize("value", [
    {"instance": "8c1f", "command": 12, "continuation": True, "lease_seconds": 30.0, "actor": None,
     "state": {"name": "Zoë", "items": [1, 2.5, "x"], "nested": {"a": [None, False]}}},
    {"big": 2**70, "negative": -(2**65)},  # beyond 64 bits: orjson refuses, the standard encoder writes it
    {1: "int key", "s": "str key"},  # non-string keys become strings, as the standard encoder does
    [],
    "text with \"quotes\" and \u2028",
])
def test_same_json_as_the_standard_encoder(value: Any) -> None:
    assert json.loads(dumps(value)) == json.loads(_standard(value))


def test_big_integers_stay_exact() -> None:
    assert json.loads(dumps({"n": 2**70 + 1}))["n"] == 2**70 + 1


@pytest.mark.parametrize("value", [{"big": 2**70}, {"state": {"name": "Zoë"}, "n": [1, 2.5]}, {1: "int key"}])
def test_size_is_the_bytes_of_the_text(value: Any) -> None:
    assert size(value) == len(dumps(value).encode())


@pytest.mark.parametrize("text", [
    '{"n": 123456789012345678901234567890, "m": -18446744073709551617}',  # beyond 64 bits: orjson gives floats
    '[999999999999999999, 1000000000000000000, -1000000000000000001]',  # either side of the 19 digits
    '[0.1000000000000000055511151231257827, 1e400, -1e400]',  # a long fraction; beyond a double: orjson refuses
    '[NaN, Infinity, -Infinity]',  # not JSON, but json.loads reads them
    '"\\ud800 unpaired"',  # an unpaired surrogate: orjson refuses
    '{"a": 1, "a": 2, "z": "Zoë", "e": "\\ud83d\\ude00", "f": [1.5, -0, 2E3, true, null]}',
])
def test_reads_what_the_standard_decoder_reads(text: str) -> None:
    read, standard = loads(text), json.loads(text)
    assert repr(read) == repr(standard)  # repr: nan != nan, and 1 == 1.0 would hide an int read as a float


def test_a_large_document_reads_the_same() -> None:
    document = {"items": [float(i) for i in range(1500)], "done": {str(i): i * i for i in range(750)}, "big": 2**64}
    text = dumps(document)
    assert repr(loads(text)) == repr(json.loads(text)) == repr(document)
