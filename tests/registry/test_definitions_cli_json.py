"""`-o json` on every `stepstone definitions` command, as on the rest of the CLI (the README: "Add -o json
to any command"): validate, publish, activate, deprecate and reinstate printed text only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
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
                                                     "of_scope": "default", "schedules_refused": []}
    assert run("deprecate", "approval", "1", *db)["before"] == "AVAILABLE"
    assert run("reinstate", "approval", "1", *db) == {"workflow": "approval", "version": 1, "scope": "default",
                                                      "before": "DEPRECATED", "status": "AVAILABLE"}


def test_reinstate_says_already_available_and_refuses_an_app_without_the_version(
        database_url: str, tmp_path: Path) -> None:
    runner = CliRunner()
    db = ("--database-url", database_url)
    (tmp_path / "v1.yaml").write_text(APPROVAL)
    (tmp_path / "v2.yaml").write_text(APPROVAL.replace("version: 1", "version: 2"))
    for version in (1, 2):
        assert runner.invoke(cli, ["definitions", "publish", str(tmp_path / f"v{version}.yaml"), "--catalog",
                                   CATALOG, *db]).exit_code == 0
    same = runner.invoke(cli, ["definitions", "reinstate", "approval", "1", *db])
    assert same.exit_code == 0, same.output
    assert same.stdout.strip() == "approval v1 (scope default): already AVAILABLE, nothing changed"
    deprecated = runner.invoke(cli, ["definitions", "deprecate", "approval", "2", *db, "-o", "json"])
    assert json.loads(deprecated.stdout)["before"] == "AVAILABLE"
    lacking = runner.invoke(cli, ["definitions", "reinstate", "approval", "2", *db,
                                  "--app", "tests.registry.test_migration_joins:registry"])
    assert lacking.exit_code == 1
    assert lacking.stderr.startswith("error: --app has no approval v2, so its plan hash cannot be checked")
    listed = runner.invoke(cli, ["definitions", "list", "--workflow", "approval", *db, "-o", "json"])
    assert {r["version"]: r["status"] for r in json.loads(listed.stdout)} == {1: "AVAILABLE", 2: "DEPRECATED"}


def test_reinstate_of_an_available_version_with_other_code_is_drift(
        database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`reinstate --app` checks the app's code against the recorded version; for a version already AVAILABLE
    it answered "already AVAILABLE, nothing changed" (exit 0) to code of another structure, as if it
    matched. Now that is drift (exit 1), named as such; nothing changes either way."""
    runner = CliRunner()
    db = ("--database-url", database_url)
    (tmp_path / "v1.yaml").write_text(APPROVAL)
    assert runner.invoke(cli, ["definitions", "publish", str(tmp_path / "v1.yaml"), "--catalog", CATALOG,
                               *db]).exit_code == 0
    (tmp_path / "other_approval.py").write_text(
        "from stepstone.authoring.workflow import Registry, Workflow\n"
        "wf = Workflow('approval', version=1)\n"
        "@wf.step(start=True, next=None)\n"
        "def only(ctx, state):\n"
        "    return None\n"
        "registry = Registry(wf)\n")
    monkeypatch.chdir(tmp_path)
    drifted = runner.invoke(cli, ["definitions", "reinstate", "approval", "1", *db, "--app", "other_approval:registry"])
    assert drifted.exit_code == 1, drifted.output
    [line] = drifted.stderr.strip().splitlines()
    assert line.startswith("error: drift: workflow 'approval' v1 (scope default) was registered with plan "), line
    assert "it is AVAILABLE, but that code is not this version" in line
    listed = runner.invoke(cli, ["definitions", "list", "--workflow", "approval", *db, "-o", "json"])
    assert {r["version"]: r["status"] for r in json.loads(listed.stdout)} == {1: "AVAILABLE"}
