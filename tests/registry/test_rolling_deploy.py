"""A rolling deploy with real worker processes: `stepstone demo rolling-deploy` runs a v1 and a v2 worker
process side by side, stops v1 while its instances wait, and brings it back. v1 instances finish on v1
workers and v2 on v2; while no v1 worker runs, v1 instances are deferred and reported stranded, never
failed."""

from __future__ import annotations

import re

from click.testing import CliRunner

from stepstone.cli import cli


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
