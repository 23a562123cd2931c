"""Architecture rules, enforced mechanically: a pure core, and SQL only in the store."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "stepstone"

FORBIDDEN_IN_CORE = (
    "asyncio",
    "asyncpg",
    "psycopg",
    "socket",
    "threading",
    "subprocess",
    "os",
    "time",
    "stepstone.store",
    "stepstone.runtime",
    "stepstone.cli",
    "stepstone.web",
    "stepstone.outbox",
    "stepstone.client",
)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Absolute module names imported by ``path`` (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = ".".join(("stepstone", *path.relative_to(SRC).parent.parts))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _forbidden(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN_IN_CORE)


def core_violations() -> list[str]:
    core = SRC / "core"
    files = sorted(core.rglob("*.py")) if core.is_dir() else []
    return [
        f"{path.relative_to(SRC.parent)}:{line} imports {module}"
        for path in files
        for line, module in _imports(path)
        if _forbidden(module)
    ]


def test_core_imports_nothing_impure() -> None:
    assert core_violations() == []


@pytest.mark.parametrize(
    ("source", "bad"),
    [
        ("import os", True),
        ("import os.path", True),
        ("from time import monotonic", True),
        ("from stepstone.store import database", True),
        ("from stepstone import store", True),
        ("from ..store import x", True),
        ("import asyncpg", True),
        ("from stepstone.errors import StepstoneError", False),
        ("import timeit", False),
        ("from dataclasses import dataclass", False),
    ],
)
def test_rule_detects(tmp_path: Path, source: str, bad: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_src = tmp_path / "stepstone"
    (fake_src / "core").mkdir(parents=True)
    (fake_src / "core" / "m.py").write_text(source + "\n")
    monkeypatch.setitem(globals(), "SRC", fake_src)
    assert bool(core_violations()) is bad


def test_only_store_holds_sql_files() -> None:
    outside = [p.relative_to(SRC) for p in SRC.rglob("*.sql") if p.relative_to(SRC).parts[0] != "store"]
    assert outside == []
