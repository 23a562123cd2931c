"""Reading the SQL files shipped in ``stepstone.store`` and rendering their schema placeholder.

SQL files name the schema with the literal placeholder ``{{schema}}``; :func:`render` is the one place
it is replaced, always by the validated, double-quoted identifier. Another identifier a statement takes
(``{{database}}`` in ``bench.sql``) is composed in the same way by :func:`render_identifier`; a name
stepstone does not choose (a role) is quoted by :func:`quote_name`, whatever its characters.
"""

from __future__ import annotations

from importlib import resources

from stepstone.config import quote_ident
from stepstone.errors import InvalidInput

__all__ = ["SCHEMA_PLACEHOLDER", "quote_name", "read_text", "render", "render_identifier"]

SCHEMA_PLACEHOLDER = "{{schema}}"


def render(sql_text: str, schema: str) -> str:
    """Replace every ``{{schema}}`` in ``sql_text`` by the quoted identifier of ``schema`` (validated)."""
    return sql_text.replace(SCHEMA_PLACEHOLDER, quote_ident(schema))


def render_identifier(sql_text: str, placeholder: str, name: str) -> str:
    """Replace every ``{{placeholder}}`` in ``sql_text`` by the quoted identifier ``name`` (validated)."""
    return sql_text.replace("{{" + placeholder + "}}", quote_ident(name))


MAX_NAME_BYTES = 63
"""The longest name PostgreSQL keeps (NAMEDATALEN - 1); it would truncate a longer one silently."""


def quote_name(name: str, what: str) -> str:
    """Any name PostgreSQL can hold (a role: 1 to 63 bytes, no NUL) as a quoted identifier, its double
    quotes doubled. Unlike a schema name, stepstone does not choose these: `App-Runtime` is a fine role."""
    reason = None
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        reason = "it is not valid text"
    else:
        if not size:
            reason = "it is empty"
        elif "\0" in name:
            reason = "it contains a NUL character"
        elif size > MAX_NAME_BYTES:
            reason = f"longer than {MAX_NAME_BYTES} bytes"
    if reason is not None:
        raise InvalidInput(f"invalid {what} name {name!r}: {reason}", what=what)
    return '"' + name.replace('"', '""') + '"'


def read_text(*parts: str) -> str:
    """Text of a file shipped under the ``stepstone.store`` package, e.g. ``read_text("schema.sql")``."""
    node = resources.files("stepstone.store")
    for part in parts:
        node = node.joinpath(part)
    return node.read_text(encoding="utf-8")
