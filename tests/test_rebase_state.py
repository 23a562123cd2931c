"""Carrying one position's change onto a state another position changed (`rebase_state` in SQL)."""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pytest

from stepstone.core.patch import changes


async def _rebase(url: str, base: Any, mine: Any, current: Any) -> Any:
    conn = await asyncpg.connect(url)
    try:
        out = await conn.fetchval(
            "SELECT stepstone.rebase_state($1::jsonb, $2::jsonb)", json.dumps(current), json.dumps(changes(base, mine))
        )
    finally:
        await conn.close()
    return None if out is None else json.loads(out)


@pytest.mark.parametrize(("base", "mine", "current", "merged"), [
    # Different keys: both land.
    ({"r": {}}, {"r": {"a": 1}}, {"r": {"b": 2}}, {"r": {"a": 1, "b": 2}}),
    ({"n": 1, "m": 1}, {"n": 2, "m": 1}, {"n": 1, "m": 5}, {"n": 2, "m": 5}),
    ({"x": 1, "y": 1}, {"y": 1}, {"x": 1, "y": 2}, {"y": 2}),  # a remove of a key nobody else touched
    # The same key: refused, so the step runs again on the current state.
    ({"n": 1}, {"n": 2}, {"n": 3}, None),
    ({"log": []}, {"log": ["a"]}, {"log": ["b"]}, None),  # lists are replaced whole: no interleaving
    ({"r": {}}, {"r": {"a": 1}}, {"r": {"a": 7}}, None),  # both added the same key
    ({"r": {}}, {"r": {"a": 1}}, {"r": "gone"}, None),  # the parent is no longer an object
    ({"x": 1}, {}, {}, None),  # both removed it: the remove finds nothing to remove
])
async def test_rebase(database_url: str, base: Any, mine: Any, current: Any, merged: Any) -> None:
    assert await _rebase(database_url, base, mine, current) == merged


def test_changes_name_what_the_step_found() -> None:
    assert changes({"a": 1, "b": {"c": 2}}, {"a": 2, "b": {}, "d": None}) == [
        {"path": ["a"], "old": 1, "value": 2},
        {"path": ["b", "c"], "old": 2},
        {"path": ["d"], "value": None},
    ]
