"""The import contracts of pyproject.toml ([tool.importlinter]) hold, and breaking one is caught.

`.ci/run` runs `lint-imports` too; this test runs it on the tree and on a copy with a planted
violation of each contract, so a contract that was dropped or mistyped cannot pass silently.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONTRACTS = {"core-pure", "runtime-on-ports", "client-on-ports", "client-without-runtime", "api-thin"}



def lint(root: Path) -> subprocess.CompletedProcess[str]:
    assert LINT_IMPORTS.exists(), "install the test extra: pip install -e '.[test]' (it has import-linter)"
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-logo", "--no-cache", str(root / "pyproject.toml")],
        cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False,
    )


def test_contracts_are_configured() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    assert config["root_package"] == "stepstone"
    assert config["include_external_packages"] is True  # else asyncpg and asyncio are invisible
    assert {c["id"] for c in config["contracts"]} == CONTRACTS


def test_contracts_are_kept() -> None:
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(CONTRACTS)} kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("core/pin.py", "import asyncio", "core does no I/O"),
        ("core/plan.py", "from stepstone.store import port", "core does no I/O"),
        ("runtime/handlers.py", "import asyncpg", "the runtime reaches neither"),
        ("runtime/committer.py", "from stepstone.store import postgres", "the runtime reaches neither"),
        ("client.py", "from stepstone.store import database", "client, testing and ops"),
        ("testing/__init__.py", "import asyncpg", "client, testing and ops"),
        ("client.py", "from stepstone.runtime.worker import Worker", "the client needs no worker"),
        ("api/routes/meta.py", "from stepstone.store import postgres", "the API and the UI reach neither"),
        ("ui/render.py", "import asyncpg", "the API and the UI reach neither"),
    ],
)
def test_a_planted_violation_breaks_its_contract(tmp_path: Path, module: str, line: str, contract: str) -> None:
    shutil.copytree(ROOT / "src" / "stepstone", tmp_path / "src" / "stepstone",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "src" / "stepstone" / module
    target.write_text(target.read_text(encoding="utf-8") + f"\n{line}  # noqa\n", encoding="utf-8")
    result = lint(tmp_path)
    assert result.returncode != 0, result.stdout
    assert "0 broken" not in result.stdout, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[1]  # a runtime violation also breaks testing's
    assert contract in broken, result.stdout
