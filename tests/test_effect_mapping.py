"""Every effect type the core can return has its writer and its SQL in the store, in one place."""

from __future__ import annotations

import re

from stepstone.core import effects
from stepstone.store.effects import SECTION_SQL, WRITERS
from stepstone.store.sqlfiles import read_text


def _all_effect_types() -> set[type[effects.Effect]]:
    return {
        obj for obj in vars(effects).values()
        if isinstance(obj, type) and issubclass(obj, effects.Effect) and obj is not effects.Effect
    }


def _commit_sql() -> str:
    text = read_text("migrations", "0002_positions.sql")
    # commit_decision and the functions it calls make up the commit.
    called = set(re.findall(r"\{\{schema\}\}\.(\w+)\(", _function(text, "commit_decision")))
    return "\n".join(_function(text, name) for name in {"commit_decision", *called} if _has(text, name))


def _has(text: str, name: str) -> bool:
    return f"FUNCTION {{{{schema}}}}.{name}(" in text


def _function(text: str, name: str) -> str:
    start = text.index(f"FUNCTION {{{{schema}}}}.{name}(")
    return text[start:text.index("END $$;", start)]


def test_every_effect_type_has_a_writer_and_sql() -> None:
    types = _all_effect_types()
    assert types, "the core defines effect types"
    assert types == set(WRITERS), f"effects without a writer: {types - set(WRITERS)}"
    assert types == set(SECTION_SQL), f"effects without SQL: {types - set(SECTION_SQL)}"
    sql = _commit_sql()
    for kind, fragment in SECTION_SQL.items():
        assert fragment in sql, f"{kind.__name__}: {fragment!r} is not in commit_decision"


def test_a_new_effect_type_without_a_mapping_is_caught() -> None:
    class Unmapped(effects.Effect):
        pass

    effects.Unmapped = Unmapped  # type: ignore[attr-defined]
    try:
        assert _all_effect_types() - set(WRITERS) == {Unmapped}
    finally:
        del effects.Unmapped  # type: ignore[attr-defined]
