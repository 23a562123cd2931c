"""The testing kit's examples, in its docstrings and the docs, await every coroutine of the engine: a
coroutine that is not awaited asserts nothing."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import stepstone.testing
import stepstone.testing.plugin
from stepstone.testing import Engine

ROOT = Path(__file__).resolve().parents[2]
COROUTINES = sorted(name for name, fn in inspect.getmembers(Engine, inspect.iscoroutinefunction)
                    if not name.startswith("_"))
TEXTS = {
    "stepstone.testing": stepstone.testing.__doc__ or "",
    "stepstone.testing.plugin": stepstone.testing.plugin.__doc__ or "",
    "docs/testing.md": (ROOT / "docs" / "testing.md").read_text(encoding="utf-8"),
    "docs/authoring.md": (ROOT / "docs" / "authoring.md").read_text(encoding="utf-8"),
    "README.md": (ROOT / "README.md").read_text(encoding="utf-8"),
}


def test_the_engines_coroutines_are_known() -> None:
    assert {"advance", "assert_step_ran", "run_until_idle", "step_runs"} <= set(COROUTINES)


@pytest.mark.parametrize("where", sorted(TEXTS))
def test_every_engine_coroutine_in_an_example_is_awaited(where: str) -> None:
    call = re.compile(r"(\S+\s+)?\bengine\.(" + "|".join(COROUTINES) + r")\(")
    unawaited = [m.group(0).strip() for m in call.finditer(TEXTS[where])
                 if not (m.group(1) or "").strip().endswith("await")]  # `await ...` in a sentence too
    assert unawaited == [], f"{where}: {unawaited}"
