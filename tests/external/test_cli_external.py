"""``stepstone external serve | list`` from the command line (the doc's curl worker runs serve end to end)."""

from __future__ import annotations

import json
import socket

from click.testing import CliRunner

from stepstone.cli import cli


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
    assert json.loads(result.stdout) == []
    bad = CliRunner().invoke(cli, ["external", "list", "--status", "lost", "--database-url", database_url])
    assert bad.exit_code == 2
