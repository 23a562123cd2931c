"""A rolling deploy with real worker processes: `stepstone demo rolling-deploy` runs a v1 and a v2 worker
process side by side, stops v1 while its instances wait, and brings it back. v1 instances finish on v1
workers and v2 on v2; while no v1 worker runs, v1 instances are deferred and reported stranded, never
failed."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from stepstone.cli import cli

ROOT = Path(__file__).resolve().parent.parent.parent


def test_demo_rolling_deploy(database_url: str) -> None:
    result = CliRunner().invoke(cli, ["demo", "rolling-deploy", "--database-url", database_url],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[-1] == ("rolling-deploy: 0 failed, 0 stranded; v1 finished 3 on v1 workers, "
                         "v2 finished 3 on v2 workers")
    stranded = [line for line in lines if line.startswith("stranded: ")]
    assert len(stranded) == 1, lines
    assert re.fullmatch(r"stranded: rollout v1 \(plan [0-9a-f]{12}\): 3 instance\(s\), 3 deferred command\(s\), "
                        r"no live worker serves it", stranded[0])
    assert "v1 instances while no v1 worker runs: 3 waiting (deferred, not failed), 0 failed" in lines


@pytest.mark.first_pass_only  # it drives the CLI, as tests/test_doc_commands.py does
def test_choosing_the_version_runs_as_written_on_a_fresh_database(database_url: str) -> None:
    """docs/versions.md "Choosing the version" on its own (test_doc_commands runs it after the demo,
    which had recorded v1 first): its first start by id is v1, the current version, its second v2."""
    text = (ROOT / "docs" / "versions.md").read_text(encoding="utf-8")
    section = text[text.index("## Choosing the version"):text.index("## Migrating running instances")]
    [block] = section.split("```sh\n")[1:]  # the section's one shell block, each start's id kept
    script = block.split("```")[0].replace("start rollout", "start rollout >> started.txt; : ")
    stop_jobs = "trap 'jobs -p | xargs -r kill 2>/dev/null; wait' EXIT"  # the worker it starts
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSTONE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["STEPSTONE_DATABASE_URL"] = database_url
    with tempfile.TemporaryDirectory(prefix="stepstone-versions-") as cwd:
        proc = subprocess.Popen(["bash", "-c", f"set -euo pipefail\n{stop_jobs}\n{script}"], cwd=cwd, env=env,
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            _out, err = proc.communicate(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        assert proc.returncode == 0, err
        started = (Path(cwd) / "started.txt").read_text().split()
    listed = CliRunner().invoke(cli, ["list", "-o", "json", "--database-url", database_url])
    version_of = {i["id"]: i["version"] for i in json.loads(listed.stdout)["instances"]}
    assert [version_of[i] for i in started] == [1, 2], (started, version_of)
