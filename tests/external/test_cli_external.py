"""``stepstone external serve | list`` from the command line (the doc's curl worker runs serve end to end)."""

from __future__ import annotations

import asyncio
import json
import socket

from click.testing import CliRunner

from stepstone.cli import cli
from stepstone.testing import open_engine
from tests.external import workflows
from tests.external.workflows import shipping


def test_serve_on_a_port_in_use_is_one_line(database_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(cli, ["external", "serve", "--port", str(port), "--database-url", database_url])
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_list_filters(database_url: str) -> None:
    result = CliRunner().invoke(cli, ["external", "list", "--status", "open", "--database-url", database_url,
                                      "-o", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"tasks": [], "next_cursor": None}
    bad = CliRunner().invoke(cli, ["external", "list", "--status", "lost", "--database-url", database_url])
    assert bad.exit_code == 2


def test_list_pages(database_url: str) -> None:
    """`external list` showed the first --limit tasks (at most 10,000) and no more, its JSON a bare list."""
    async def forked() -> None:  # three tasks made in one commit
        async with open_engine(database_url, workflows.registry) as engine:
            await engine.client.start(shipping, {})
            await engine.run_until_idle()

    asyncio.run(forked())

    def listed(*args: str) -> dict[str, object]:
        result = CliRunner().invoke(cli, ["external", "list", "--database-url", database_url, "-o", "json", *args])
        assert result.exit_code == 0, result.output
        page: dict[str, object] = json.loads(result.stdout)
        return page

    first, whole = listed("--limit", "2"), listed()
    assert whole["next_cursor"] is None and len(whole["tasks"]) == 3  # type: ignore[arg-type]
    second = listed("--limit", "2", "--after", str(first["next_cursor"]))
    assert second["next_cursor"] is None
    assert first["tasks"] + second["tasks"] == whole["tasks"]  # type: ignore[operator]
    text = CliRunner().invoke(cli, ["external", "list", "--database-url", database_url, "--limit", "1"]).stdout
    assert text.splitlines()[-1].startswith("next page: --after ")
    bad = CliRunner().invoke(cli, ["external", "list", "--database-url", "postgresql://nowhere.invalid/x",
                                   "--after", "bm90IGEgY3Vyc29y"])
    assert (bad.exit_code, bad.stderr.strip()) == (
        1, "error: --after 'bm90IGEgY3Vyc29y' is not a cursor printed by `stepstone external list`")
