"""Named queries, read once per (file, schema) from the `.sql` files under `store/sql/`.

Each query starts with a ``-- name: <name>`` line; ``{{schema}}`` is replaced by the quoted schema
identifier (`sqlfiles.render`). A query may be a fragment another query of its file uses: where
``/*name*/`` stands, the fragment of that name is composed in (one definition of what a filter or a
state means, for every statement that asks; a fragment may name others). `queries(schema)` are the
engine's (`queries.sql`); the other files (`bench.sql`, `health.sql`) are read through `named_queries`.
"""

from __future__ import annotations

import functools
import re

from stepstone.store.sqlfiles import read_text, render

__all__ = ["named_queries", "queries"]

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
_FRAGMENT = re.compile(r"/\*(\w+)\*/")


@functools.cache
def named_queries(filename: str, schema: str) -> dict[str, str]:
    """Every named query of `sql/<filename>` with the schema identifier composed in."""
    text = render(read_text("sql", filename), schema)
    parts = _NAME.split(text)
    found: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in found:
            raise ValueError(f"query {name!r} is defined twice in {filename}")
        found[name] = body.strip()
    return {name: _compose(sql, found, ()) for name, sql in found.items()}


def _compose(sql: str, found: dict[str, str], within: tuple[str, ...]) -> str:
    """`sql` with each fragment composed in, and the fragments a fragment names composed into it."""
    def fragment(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in found:
            return m.group(0)
        if name in within:
            raise ValueError(f"fragment {name!r} composes itself")
        return _compose(found[name], found, (*within, name))
    return _FRAGMENT.sub(fragment, sql)


def queries(schema: str) -> dict[str, str]:
    """The engine's named queries (`sql/queries.sql`)."""
    return named_queries("queries.sql", schema)
