"""The store's named queries, read once per (schema, file) from `sql/*.sql`."""

from __future__ import annotations

import functools
import re

from stepstone.store.sqlfiles import read_text, render

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@functools.cache
def queries(schema: str, file: str = "queries.sql") -> dict[str, str]:
    """Every named query of `sql/<file>` with the schema identifier composed in."""
    text = render(read_text("sql", file), schema)
    parts = _NAME.split(text)
    found: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in found:
            raise ValueError(f"query {name!r} is defined twice in {file}")
        found[name] = body.strip()
    return found
