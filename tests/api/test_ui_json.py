"""The UI writes documents (states, errors, task data) as the standard JSON encoder indents them, with
sorted keys, whether orjson writes them (fast) or the standard encoder does (what orjson refuses). Only
the spelling of a float's exponent may differ (1e-7 for 1e-07): the same number."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest

from stepstone.ui.render import _pretty


@dataclass
class _Shown:
    n: int


DOCUMENTS: list[Any] = [
    {"b": 1, "a": [1, 2, {"z": None, "y": "é ✓"}], "c": {}, "d": []},
    {"delay_seconds": 2592000.0, "tenth": 0.1, "negative": -3, "third": 1 / 3},
    {"line separator": "\u2028", "quote": '"', "backslash": "\\", "tab": "\t", "nul-free control": "\x01"},
    {"at": datetime(2026, 12, 5, 17, 0, tzinfo=UTC), "id": uuid.UUID(int=5), "shown": _Shown(1)},
    {"beyond 64 bits": 10**30},  # orjson refuses it: the standard encoder writes it
    {1: "a key that is not a string"},  # likewise
    [], {}, "text", 7, None, True,
]


@pytest.mark.parametrize("document", DOCUMENTS, ids=range(len(DOCUMENTS)))
def test_a_document_reads_as_the_standard_encoder_writes_it(document: Any) -> None:
    assert _pretty(document) == json.dumps(document, indent=2, ensure_ascii=False, sort_keys=True, default=str)


def test_a_float_with_an_exponent_is_the_same_number() -> None:
    document = {"tiny": 1e-7, "huge": 1.5e300}
    assert json.loads(_pretty(document)) == document
    assert _pretty(document).splitlines()[0] == "{"
