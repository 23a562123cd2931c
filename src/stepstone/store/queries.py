"""The engine's named queries, read once from `sql/queries.sql` per schema."""

from __future__ import annotations

import functools
import re

from stepstone.store.sqlfiles import read_text, render

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@functools.cache
def queries(schema: str) -> dict[str, str]:
    """Every named query with the schema identifier composed in."""
    text = render(read_text("sql", "queries.sql"), schema)
    parts = _NAME.split(text)
    found: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in found:
            raise ValueError(f"query {name!r} is defined twice in queries.sql")
        found[name] = body.strip()
    return found
