"""The operator CLI's surface: `-o json` on every operator command, the same instance filters on every
command that selects instances, `db grant -o json` lists exactly the statements it prints."""

from __future__ import annotations

import json

import click
from click.testing import CliRunner

from stepstone.cli import cli
from stepstone.cli import operations as ops_cli
from stepstone.testing import Engine
from tests.ops import workflows
from tests.ops.test_cli_operations import run


def _leaves(command: click.Command, path: str = "") -> list[tuple[str, click.Command]]:
    name = f"{path} {command.name}".strip()
    if isinstance(command, click.Group):
        return [leaf for sub in command.commands.values() for leaf in _leaves(sub, name)]
    return [(name, command)]


def _options(command: click.Command) -> dict[str, click.Option]:
    return {p.name or "": p for p in command.params if isinstance(p, click.Option)}


OPERATOR_COMMANDS = [leaf for c in [*ops_cli.commands, ops_cli.grant_command] for leaf in _leaves(c)]


def test_every_operator_command_takes_output_json() -> None:
    assert {name for name, _ in OPERATOR_COMMANDS} == {
        "find", "list", "inspect", "history", "probe", "stuck", "retention policies", "retention set", "retention run",
        "repair retry", "repair cancel", "replay", "grant"}
    for name, command in OPERATOR_COMMANDS:
        output = _options(command).get("output")
        assert output is not None and "-o" in output.opts, f"{name} has no -o"
        assert isinstance(output.type, click.Choice) and "json" in output.type.choices, name


def test_commands_that_select_instances_take_the_same_filters() -> None:
    @ops_cli.filter_options
    def reference(**_: object) -> None: ...

    expected = {p.name for p in getattr(reference, "__click_params__", [])}
    assert {"statuses", "workflow", "scope", "since", "until", "business_key"} <= expected
    selecting = {name: set(_options(c)) for name, c in OPERATOR_COMMANDS if "workflow" in _options(c)}
    # A retention sweep narrows by workflow and scope alone: the status classes are its policies'.
    assert {"workflow", "scope"} <= selecting.pop("retention run")
    assert set(selecting) == {"find", "list", "probe", "stuck", "repair retry", "repair cancel"}
    for name, options in selecting.items():
        assert expected <= options, f"{name} lacks {expected - options}"
        status = _options(dict(OPERATOR_COMMANDS)[name])["statuses"]
        assert status.multiple and "--status" in status.opts, name


def test_db_grant_json_lists_the_statements_it_prints(database_url: str) -> None:
    runner = CliRunner()
    text = runner.invoke(cli, ["--database-url", database_url, "db", "grant", "app_rt"])
    data = runner.invoke(cli, ["--database-url", database_url, "db", "grant", "app_rt", "-o", "json"])
    assert text.exit_code == 0 and data.exit_code == 0, (text.output, data.output)
    doc = json.loads(data.stdout)
    assert (doc["role"], doc["read_only"], doc["applied"]) == ("app_rt", False, False)
    assert doc["statements"] == text.stdout.strip().splitlines()
    assert any(s.startswith("GRANT USAGE ON SCHEMA") for s in doc["statements"])


async def test_inspect_says_which_step_retries_and_when(engine: Engine, database_url: str) -> None:
    iid = await engine.client.start(workflows.flaky, {})
    workflows.FAILURES[iid] = 1
    await engine.run_until_idle()  # attempt 1 failed: waiting out a 30 s backoff
    table = await run(database_url, "inspect", iid)
    assert table.exit_code == 0, table.output
    assert "retrying step work, attempt 2 of 5, next at " in table.stdout
    data = json.loads((await run(database_url, "inspect", iid, "-o", "json")).stdout)
    assert [(r["step"], r["attempt"], r["max_attempts"]) for r in data["retrying"]] == [("work", 2, 5)]
