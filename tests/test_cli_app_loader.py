"""``--app module:attribute``: what it accepts and the one-line errors for what it does not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stepstone.authoring.workflow import Registry
from stepstone.cli.app import load_app
from stepstone.cli.common import CliError


def test_loads_a_registry() -> None:
    registry = load_app("tests.cli_apps:registry")
    assert {wf.id for wf in registry} == {"hello", "approval", "flaky", "slow", "held", "refund_saga"}


def test_wraps_a_single_workflow() -> None:
    registry = load_app("stepstone.examples.orders:orders")
    assert isinstance(registry, Registry)
    assert [wf.id for wf in registry] == ["order"]


def test_current_directory_is_importable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_flows_cwd.py").write_text(
        "from stepstone.authoring.workflow import Workflow\n"
        "wf = Workflow('local')\n"
        "@wf.step(next=None)\n"
        "def only(ctx, state):\n"
        "    pass\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    assert [wf.id for wf in load_app("my_flows_cwd:wf")] == ["local"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "must look like module:attribute"),
        ("tests.cli_apps:", "must look like module:attribute"),
        ("no_such_module_xyz:registry", "no module named 'no_such_module_xyz'"),
        ("tests.no_such_module:registry", "no module named 'tests.no_such_module'"),
        ("tests.cli_apps:missing", "has no attribute 'missing'"),
        ("tests.cli_apps:not_a_registry", "is a int, not a stepstone Registry or Workflow"),
    ],
)
def test_errors_are_one_line(spec: str, message: str) -> None:
    with pytest.raises(CliError) as info:
        load_app(spec)
    text = info.value.format_message()
    assert message in text
    assert "\n" not in text


@pytest.mark.parametrize(
    ("spec", "dotted"),
    [
        ("tests/cli_apps.py:registry", "tests.cli_apps:registry"),
        ("./tests/cli_apps.py:registry", "tests.cli_apps:registry"),
        ("tests/cli_apps:registry", "tests.cli_apps:registry"),
        ("cli_apps.py:registry", "cli_apps:registry"),
    ],
)
def test_a_file_path_for_a_module_is_told_the_module_s_dotted_name(spec: str, dotted: str) -> None:
    """A file path where the module's name goes failed as "no module named 'tests/cli_apps.py'" or, with a
    leading ./, as "TypeError: the 'package' argument is required to perform a relative import"."""
    with pytest.raises(CliError) as info:
        load_app(spec)
    assert info.value.format_message() == (
        f"--app takes a module's dotted name, not a file path: {dotted} (from the directory the path starts "
        f"in), not {spec!r}")


def test_error_inside_the_module_is_reported_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_flows_mod.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CliError) as info:
        load_app("broken_flows_mod:registry")
    text = info.value.format_message()
    assert "importing 'broken_flows_mod' failed" in text
    assert "not_installed_dependency_xyz" in text
