"""Reading the SQL files shipped in ``stepstone.store`` and rendering their schema placeholder.

SQL files name the schema with the literal placeholder ``{{schema}}``; :func:`render` is the one place
it is replaced, always by the validated, double-quoted identifier. Another identifier a statement takes
(``{{database}}`` in ``bench.sql``) is composed in the same way by :func:`render_identifier`.
"""

from __future__ import annotations

from importlib import resources

from stepstone.config import quote_ident

__all__ = ["SCHEMA_PLACEHOLDER", "read_text", "render", "render_identifier"]

SCHEMA_PLACEHOLDER = "{{schema}}"


def render(sql_text: str, schema: str) -> str:
    """Replace every ``{{schema}}`` in ``sql_text`` by the quoted identifier of ``schema`` (validated)."""
    return sql_text.replace(SCHEMA_PLACEHOLDER, quote_ident(schema))


def render_identifier(sql_text: str, placeholder: str, name: str) -> str:
    """Replace every ``{{placeholder}}`` in ``sql_text`` by the quoted identifier ``name`` (validated)."""
    return sql_text.replace("{{" + placeholder + "}}", quote_ident(name))


def read_text(*parts: str) -> str:
    """Text of a file shipped under the ``stepstone.store`` package, e.g. ``read_text("schema.sql")``."""
    node = resources.files("stepstone.store")
    for part in parts:
        node = node.joinpath(part)
    return node.read_text(encoding="utf-8")
