"""Every effect type the core can return has its writer and its SQL in the store, in one place."""

from __future__ import annotations

import re

from stepstone.core import effects
from stepstone.store import migrate
from stepstone.store.effects import FEATURE_SECTION, SECTION_SQL, WRITERS, _Doc


def _all_effect_types() -> set[type[effects.Effect]]:
    return {
        obj for obj in vars(effects).values()
        if isinstance(obj, type) and issubclass(obj, effects.Effect) and obj is not effects.Effect
    }


def _migrations_text() -> str:
    return "\n".join(m.sql for m in migrate.shipped_migrations())


def _latest(text: str, name: str) -> str:
    """The last definition of function ``name`` (a later migration replaces an earlier one)."""
    start = text.rindex(f"FUNCTION {{{{schema}}}}.{name}(")
    return text[start:text.index("END $$;", start)]


def _commit_sql() -> str:
    text = _migrations_text()
    # commit_decision and the functions it calls make up the commit.
    called = set(re.findall(r"\{\{schema\}\}\.(\w+)\(", _latest(text, "commit_decision")))
    return "\n".join(_latest(text, name) for name in {"commit_decision", *called} if _has(text, name))


def _feature_sections() -> dict[str, str]:
    """section -> function name, from every `INSERT INTO effect_sections` of the migrations."""
    text = _migrations_text()
    rows = re.findall(r"INSERT INTO \{\{schema\}\}\.effect_sections[^;]*;", text)
    return {s: f for row in rows for s, _, f in re.findall(r"\('(\w+)',\s*(\d+),\s*'(\w+)'\)", row)}


def _has(text: str, name: str) -> bool:
    return f"FUNCTION {{{{schema}}}}.{name}(" in text


def test_every_effect_type_has_a_writer_and_sql() -> None:
    types = _all_effect_types()
    assert types, "the core defines effect types"
    assert types == set(WRITERS), f"effects without a writer: {types - set(WRITERS)}"
    assert types == set(SECTION_SQL), f"effects without SQL: {types - set(SECTION_SQL)}"
    sql = _commit_sql()
    sections = _feature_sections()
    text = _migrations_text()
    for kind, fragment in SECTION_SQL.items():
        if fragment.startswith(FEATURE_SECTION):
            section = fragment.removeprefix(FEATURE_SECTION)
            assert section in sections, f"{kind.__name__}: section {section!r} is not in effect_sections"
            assert _has(text, sections[section]), f"{kind.__name__}: no function {sections[section]}"
        else:
            assert fragment in sql, f"{kind.__name__}: {fragment!r} is not in commit_decision"


def test_commit_decision_calls_feature_sections() -> None:
    assert "effect_sections" in _latest(_migrations_text(), "commit_decision")
    doc = _Doc("i", "", 1)
    doc.extend("tasks", {"a": 1})
    doc.extend("tasks", {"a": 2})
    assert doc.body == {"ext": {"tasks": [{"a": 1}, {"a": 2}]}}


def test_a_new_effect_type_without_a_mapping_is_caught() -> None:
    class Unmapped(effects.Effect):
        pass

    effects.Unmapped = Unmapped  # type: ignore[attr-defined]
    try:
        assert _all_effect_types() - set(WRITERS) == {Unmapped}
    finally:
        del effects.Unmapped  # type: ignore[attr-defined]
