"""`-o json` on every `stepstone definitions` command, as on the rest of the CLI (the README: "Add -o json
to any command"): validate, publish, activate, deprecate and reinstate printed text only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from stepstone.cli import cli
from tests.registry.test_documents import APPROVAL

CATALOG = "tests.registry.test_documents:catalog"


def test_the_definitions_commands_answer_in_json(database_url: str, tmp_path: Path) -> None:
    runner = CliRunner()

    def run(*args: str) -> Any:
        done = runner.invoke(cli, ["definitions", *args, "-o", "json"])
        assert done.exit_code == 0, done.output
        return json.loads(done.stdout)

    db = ("--database-url", database_url)
    for version in (1, 2):
        (tmp_path / f"v{version}.yaml").write_text(APPROVAL.replace("version: 1", f"version: {version}"))
    valid = run("validate", str(tmp_path / "v1.yaml"), "--catalog", CATALOG)
    assert (valid["valid"], valid["workflow"], valid["version"], valid["handlers_checked"]) == (
        True, "approval", 1, True)
    first = run("publish", str(tmp_path / "v1.yaml"), "--catalog", CATALOG, *db)
    assert (first["status"], first["recorded"], first["plan_hash"]) == ("AVAILABLE", "inserted", valid["plan_hash"])
    assert run("publish", str(tmp_path / "v2.yaml"), "--catalog", CATALOG, *db)["version"] == 2
    assert run("activate", "approval", "2", *db) == {"scope": "default", "workflow": "approval", "version": 2,
                                                     "of_scope": "default"}
    assert run("deprecate", "approval", "1", *db)["before"] == "AVAILABLE"
    assert run("reinstate", "approval", "1", *db) == {"workflow": "approval", "version": 1, "scope": "default",
                                                      "before": "DEPRECATED", "status": "AVAILABLE"}
