"""The engine's JSON text (stepstone.core.json_text, the store's json/jsonb encoder): orjson, the standard
encoder as fallback, writes what the standard encoder wrote, including what orjson alone refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from stepstone.core.json_text import dumps, size


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
