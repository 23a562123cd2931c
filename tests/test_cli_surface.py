"""What a newcomer meets first: `python -m stepstone`, `--app` before the command, a malformed URL
named as such, whole command summaries in `--help`, and the docs' snippets running as written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from stepstone.cli import cli

ROOT = Path(__file__).resolve().parent.parent
APP = "tests.cli_apps:registry"


def test_python_dash_m_stepstone_is_the_cli() -> None:
    result = subprocess.run([sys.executable, "-m", "stepstone", "--version"], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("stepstone, version ")


def test_app_works_before_the_command(database_url: str) -> None:
    result = CliRunner().invoke(cli, ["--app", APP, "--database-url", database_url, "start", "hello",
                                      "--input", '{"name": "ada"}'])
    assert result.exit_code == 0, result.output
    assert re.fullmatch(r"[0-9a-f-]{36}\n", result.stdout)


def test_the_command_flag_beats_the_root_flag_and_the_environment(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STEPSTONE_APP", "no.such.module:registry")
    result = CliRunner().invoke(cli, ["--app", APP, "start", "hello", "--input", '{"name": "a"}',
                                      "--database-url", database_url])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(cli, ["--app", "no.such:app", "start", "hello", "--app", APP,
                                      "--input", '{"name": "a"}', "--database-url", database_url])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("url", ["not a url", "postgresql://u:pw@h:port/db", "mysql://u@h/db",
                                 "postgresql://u:p@ss@127.0.0.1/db"])
def test_a_malformed_url_is_called_malformed(url: str) -> None:
    result = CliRunner().invoke(cli, ["list", "--database-url", url])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "malformed database URL" in lines[0], result.stderr
    assert "localhost:5432" not in lines[0] and "cannot reach" not in lines[0]


@pytest.mark.parametrize(("url", "shown"), [("sqlite:///x.db", "'sqlite:///x.db'"),
                                             ("sqlite://u:s3cr3t@h///x.db", "'sqlite://u:***@h///x.db'")])
def test_a_malformed_url_is_echoed_as_given(url: str, shown: str) -> None:
    result = CliRunner().invoke(cli, ["--database-url", url, "list"])
    assert result.exit_code == 1
    assert f"malformed database URL {shown}:" in result.stderr, result.stderr
    assert "s3cr3t" not in result.stderr


def _summaries(args: list[str]) -> dict[str, str]:
    text = CliRunner().invoke(cli, args, terminal_width=80).stdout
    listing = text.split("Commands:\n", 1)[1]
    found: dict[str, str] = {}
    name = ""
    for line in listing.splitlines():
        match = re.match(r"  (\S+)\s+(.*)", line)
        if match and not line.startswith("    "):
            name = match.group(1)
            found[name] = match.group(2)
        elif name:
            found[name] += " " + line.strip()
    return found


@pytest.mark.parametrize("args", [["--help"], ["db", "--help"], ["demo", "--help"]])
def test_help_lists_whole_summaries(args: list[str]) -> None:
    summaries = _summaries(args)
    assert {"worker", "migrate", "fanout"} & set(summaries)
    for name, summary in summaries.items():
        assert not summary.endswith("..."), f"{name}: {summary!r} is cut"
        assert summary.endswith((".", ")")), f"{name}: {summary!r}"
    if "worker" in summaries:
        assert summaries["worker"] == "Run the workflows of --app until SIGTERM/SIGINT."


def test_the_docs_agree_on_how_long_a_quick_bench_takes() -> None:
    performance = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    helped = CliRunner().invoke(cli, ["bench", "--help"], terminal_width=200).stdout
    said = re.search(r"CI size \(about ([^)]+)\)", helped)
    assert said is not None, helped
    assert f"`--quick` is the CI size (about {said.group(1)})" in performance


def test_the_readme_says_start_prints_the_id() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "`start` prints the new instance's id" in readme


def _block_after(heading: str, language: str) -> str:
    guide = (ROOT / "docs" / "authoring.md").read_text(encoding="utf-8")
    section = guide.split(heading, 1)[1]
    return section.split(f"```{language}\n", 1)[1].split("```", 1)[0]


def test_running_it_says_what_a_script_sees() -> None:
    block = _block_after("Or with a separate worker", "sh")
    shows = [line for line in block.splitlines() if line.startswith('stepstone show "$id"')]
    assert [line.split("#", 1)[1].split()[0].strip(",") for line in shows] == ["WAITING", "WAITING", "COMPLETED"]
    assert block.index("sleep") < block.index("await_payment") < block.index("stepstone signal")


async def test_the_testing_snippet_runs_as_written(database_url: str) -> None:
    code = _block_after("## Testing a workflow", "python")
    assert "open_engine" in code
    namespace: dict[str, Any] = {"__name__": "authoring_snippet"}
    exec(compile(code, "docs/authoring.md#testing-a-workflow", "exec"), namespace)  # noqa: S102 - our own doc
    tests = [value for name, value in namespace.items() if name.startswith("test_")]
    assert len(tests) == 1
    await tests[0](database_url)


def test_the_root_names_every_command_of_every_module() -> None:
    """COMMANDS (what the root loads on use) and the modules' own `commands` lists agree."""
    import importlib  # noqa: PLC0415

    from stepstone.cli import COMMANDS  # noqa: PLC0415

    declared: dict[str, str] = {}
    for module in sorted({target.split(":")[0] for target in COMMANDS.values()}):
        for command in importlib.import_module(f"stepstone.cli.{module}").commands:
            declared[command.name] = module
    assert {name: target.split(":")[0] for name, target in COMMANDS.items()} == declared
    for name in COMMANDS:
        assert cli.get_command(click.Context(cli), name).name == name  # type: ignore[union-attr]


def test_a_command_line_loads_only_its_own_commands_module() -> None:
    """`stepstone --version` imports neither the client nor any command module; `stepstone db ...`
    not the demos (their example workflows were 0.1 s of every start-up)."""
    probe = ("import sys; from stepstone.cli import main\n"
             "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in sys.modules if m.startswith(('stepstone.cli.', 'stepstone.client'))))")
    loaded = subprocess.run([sys.executable, "-c", probe, "--version"], capture_output=True, text=True,
                            timeout=60, check=True).stdout
    assert "stepstone.client" not in loaded and "stepstone.cli.db" not in loaded, loaded
    loaded = subprocess.run([sys.executable, "-c", probe, "db", "--help"], capture_output=True, text=True,
                            timeout=60, check=True).stdout
    assert "stepstone.cli.db" in loaded and "stepstone.cli.demo" not in loaded, loaded


def test_the_operations_commands_load_no_client() -> None:
    """find, list, history, inspect, repair and the other operations commands read through the operations
    module: their command lines import neither the client nor the authoring layer (pydantic with it),
    about 0.04 s of CPU of each."""
    probe = ("import sys, stepstone.cli.operations\n"
             "print([m for m in ('stepstone.client', 'stepstone.authoring.workflow', 'pydantic') if m in sys.modules])")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                            check=True).stdout
    assert loaded.strip() == "[]", loaded

def test_the_tokens_commands_load_no_web_app() -> None:
    """`stepstone tokens ...` imports stepstone.api.tokens, not the HTTP app beside it: FastAPI, the routes
    and their models were 0.3 s of CPU of each such command line, which needs none of them."""
    probe = ("import sys, stepstone.api.tokens\n"
             "print(sorted(m for m in sys.modules if m == 'fastapi' or m.startswith('stepstone.api.')))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                            check=True).stdout
    assert "fastapi" not in loaded and "stepstone.api.app" not in loaded, loaded


_EVERYWHERE = {"--app", "--database-url", "--schema", "--output", "--help"}
"""Options the conventions at the top of docs/cli.md describe once for every command."""


def _long_options(command: click.Command) -> set[str]:
    return {o for p in command.params if isinstance(p, click.Option) for o in p.opts if o.startswith("--")}


def test_the_option_tables_of_docs_cli_list_what_help_lists() -> None:
    """An options table under `## \\`stepstone COMMAND\\`` names every option of COMMAND and no other."""
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    tables = 0
    for section in text.split("\n## ")[1:]:
        heading, _, body = section.partition("\n")
        if "\n| option |" not in body:
            continue
        name = re.match(r"`stepstone ([a-z -]+)`", heading)
        assert name is not None, heading
        command: Any = cli
        for word in name.group(1).split():
            command = command.get_command(click.Context(command), word)
        rows = [line.split(" | ")[0] for line in body.split("\n| option |", 1)[1].splitlines()[2:]
                if line.startswith("| ")]
        documented = set(re.findall(r"`(--[a-z-]+)", " ".join(rows)))
        assert documented == _long_options(command) - _EVERYWHERE, heading
        tables += 1
    assert tables >= 1


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> list[tuple[str, click.Command]]:
    found: list[tuple[str, click.Command]] = []
    for name in group.list_commands(click.Context(group)):
        command = group.get_command(click.Context(group), name)
        assert command is not None
        if isinstance(command, click.Group):
            found += _commands(command, (*path, name))
        else:
            found.append((" ".join((*path, name)), command))
    return found


def _sections() -> dict[str, str]:
    """docs/cli.md's sections by the commands their heading names: `stepstone tasks ...` and
    `stepstone demo` every command of the group, `stepstone db migrate | status | sql` those three."""
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    found: dict[str, str] = {}
    for section in text.split("\n## ")[1:]:
        heading, _, body = section.partition("\n")
        for clause in re.findall(r"`stepstone ([^`]*)`", heading):
            words = [w for w in clause.split() if re.fullmatch(r"[a-z][a-z-]*|\.\.\.", w)]
            group, alternatives = words[:1], words[1:]
            if len(words) >= 3 and words[1] == "server":  # `db server status | start | stop`
                group, alternatives = words[:2], words[2:]
            for name in alternatives or ["..."]:
                found[" ".join([*group, name])] = body
    return found


def _section_of(name: str, sections: dict[str, str]) -> str | None:
    words = name.split()
    for size in range(len(words), 0, -1):  # `tasks filters save` in `tasks ...`, `demo fanout` in `demo`
        for key in (" ".join(words[:size]), " ".join([*words[:size], "..."])):
            if key in sections:
                return sections[key]
    return None


def test_every_option_of_every_command_is_documented() -> None:
    """Each command's options are named in its own section of docs/cli.md (a name anywhere under docs/
    passed before: another command's option of that name, or a word in prose, would do)."""
    sections = _sections()
    unplaced = [name for name, _ in _commands(cli) if _section_of(name, sections) is None]
    assert unplaced == [], f"no section of docs/cli.md names these commands: {unplaced}"
    missing = {name: sorted(o for o in _long_options(command) - _EVERYWHERE
                            if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", _section_of(name, sections) or ""))
               for name, command in _commands(cli)}
    assert {name: options for name, options in missing.items() if options} == {}


_WITHOUT_OUTPUT = {
    "bench": "writes its JSON report with --out",
    "db sql": "prints the SQL itself",
    "demo approval": "a narrated run", "demo fanout": "a narrated run", "demo outbox": "a narrated run",
    "demo rolling-deploy": "a narrated run", "demo saga": "a narrated run",
    "external serve": "a server until SIGTERM", "relay": "a service until SIGTERM", "serve": "a server until SIGTERM",
    "worker": "a service until SIGTERM (--log-format json for its logs)",
}
"""The commands without `-o json`, and why: each runs until stopped, narrates, or prints a document of its own."""


def test_every_command_that_answers_takes_output_json() -> None:
    """docs/cli.md's conventions: `-o json` for scripts on every command that answers (repairs and settings too:
    `outbox requeue`, `schedules pause`, `limits set` and `db migrate` printed only text)."""
    without = sorted(name for name, command in _commands(cli)
                     if not any("-o" in p.opts and "json" in getattr(p.type, "choices", ()) for p in command.params))
    assert without == sorted(_WITHOUT_OUTPUT)


def test_db_migrate_answers_in_json(empty_database_url: str) -> None:
    first = CliRunner().invoke(cli, ["db", "migrate", "--database-url", empty_database_url, "-o", "json"])
    assert first.exit_code == 0, first.output
    applied = json.loads(first.stdout)["applied"]
    assert applied[0] == {"version": 1, "name": applied[0]["name"]} and len(applied) > 60
    again = CliRunner().invoke(cli, ["db", "migrate", "--database-url", empty_database_url, "-o", "json"])
    assert json.loads(again.stdout) == {"schema": "stepstone", "applied": [], "unknown": []}
