"""Architecture rules, enforced mechanically: a pure core, and SQL only in the store."""

from __future__ import annotations

import ast
import re
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


# A string that reads as a SQL statement: a statement keyword followed by the clause that makes it one.
_SQL = re.compile(
    r"^\s*(?:"
    r"SELECT\b.*\bFROM\b|SELECT\s+[\w(*]|INSERT\s+INTO|UPDATE\s+\S+\s+SET|DELETE\s+FROM|WITH\s+\w+\s+AS\s*\("
    r"|(?:CREATE|ALTER|DROP)\s+(?:OR\s+REPLACE\s+)?(?:UNIQUE\s+)?(?:TABLE|INDEX|SCHEMA|FUNCTION|DATABASE|ROLE|VIEW"
    r"|TYPE|EXTENSION|SEQUENCE|TRIGGER)|TRUNCATE\b|GRANT\s|REVOKE\s|LISTEN\s|NOTIFY\s|VACUUM\b|ANALYZE\b"
    r"|COPY\s|SET\s+(?:LOCAL\s+)?\w+\s*(?:=|TO)|SHOW\s+\w+)",
    re.DOTALL,
)

# Each entry: a path under src/stepstone (a file, or a directory ending in "/") that may still hold SQL
# strings outside the store, and why.
SQL_OUTSIDE_STORE_ALLOWED: dict[str, str] = {}  # none: doctor and bench read theirs from store/sql/*.sql


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants and f-string texts of a module, docstrings excluded."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "x" for v in node.values)
            found.append((node.lineno, str(text)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found.append((node.lineno, node.value))
    return found


def sql_outside_store(allowed: dict[str, str] = SQL_OUTSIDE_STORE_ALLOWED) -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("store/") or any(rel == a or (a.endswith("/") and rel.startswith(a)) for a in allowed):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        found += [f"{rel}:{line}: {text.strip()[:60]!r}" for line, text in _strings(tree) if _SQL.match(text)]
    return found


def test_sql_strings_stay_in_the_store() -> None:
    """SQL lives in the store (named queries in .sql files, or its own modules), never in runtime code."""
    assert sql_outside_store() == []


def test_the_sql_allow_list_names_only_paths_that_still_hold_sql() -> None:
    for entry in SQL_OUTSIDE_STORE_ALLOWED:
        others = {k: v for k, v in SQL_OUTSIDE_STORE_ALLOWED.items() if k != entry}
        assert sql_outside_store(others), f"{entry} holds no SQL any more: remove it from the allow-list"


@pytest.mark.parametrize(
    ("source", "bad"),
    [
        ('Q = "SELECT id FROM stepstone.instances"', True),
        ('q = f"UPDATE {schema}.commands SET state = $1"', True),
        ('conn.execute("CREATE TABLE t (id int)")', True),
        ('x = """\n  WITH w AS (SELECT 1) SELECT * FROM w"""', True),
        ('conn.execute("SELECT pg_notify($1, $2)")', True),
        ('msg = "select a workflow from the list"', False),
        ('msg = "Update the settings"', False),
        ('def f():\n    """SELECT nothing FROM here: a docstring."""', False),
        ('label = "DELETE"', False),
    ],
)
def test_sql_rule_detects(tmp_path: Path, source: str, bad: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_src = tmp_path / "stepstone"
    (fake_src / "runtime").mkdir(parents=True)
    (fake_src / "runtime" / "m.py").write_text(source + "\n")
    (fake_src / "store").mkdir()
    (fake_src / "store" / "s.py").write_text('Q = "SELECT 1 FROM t"\n')  # the store may
    monkeypatch.setitem(globals(), "SRC", fake_src)
    assert bool(sql_outside_store({})) is bad
