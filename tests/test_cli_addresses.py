"""The address a listening command prints is one a browser or curl takes: an IPv6 literal in brackets."""

from __future__ import annotations

import signal

import pytest

from stepstone.cli.addresses import host_port, http_url
from tests.test_cli_worker import DEADLINE, spawn


def test_an_ipv6_literal_is_bracketed_and_nothing_else() -> None:
    assert http_url("::1", 8795, "/ui/") == "http://[::1]:8795/ui/"
    assert http_url("[::1]", 8795) == "http://[::1]:8795"  # given bracketed: not twice
    assert host_port("fe80::1", 80) == "[fe80::1]:80"
    assert http_url("127.0.0.1", 8080, "/ui/") == "http://127.0.0.1:8080/ui/"
    assert host_port("localhost", 9464) == "localhost:9464"


@pytest.mark.parametrize(("args", "said"), [
    (["serve", "--host", "::1", "--port", "0", "--no-auth"], "serving http://[::1]:"),
    (["worker", "--app", "tests.cli_apps:registry", "--metrics-host", "::1", "--metrics-port", "0"],
     "health and metrics on http://[::1]:"),
    (["external", "serve", "--host", "::1", "--port", "0"], "external tasks on http://[::1]:"),
])
async def test_the_printed_url_of_an_ipv6_listener_is_bracketed(database_url: str, args: list[str],
                                                                said: str) -> None:
    proc = await spawn(*args, "--database-url", database_url)
    try:
        await proc.line_containing(said)
    finally:
        if proc.proc.returncode is None:
            proc.proc.send_signal(signal.SIGTERM)
        await proc.exit_code(DEADLINE)


def test_a_port_in_use_on_an_ipv6_literal_is_named_bracketed() -> None:
    from stepstone.cli.common import CliError, listening_socket  # noqa: PLC0415

    held = listening_socket("::1", 0)
    try:
        port = held.getsockname()[1]
        held.listen()
        with pytest.raises(CliError, match=rf"^cannot listen on \[::1\]:{port}: "):
            listening_socket("::1", port)
    finally:
        held.close()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize(("args", "said"), [
    (["serve", "--port", "0", "--no-auth"], "serving http://127.0.0.1:"),
    (["external", "serve", "--port", "0"], "external tasks on http://127.0.0.1:"),
], ids=["serve", "external-serve"])
async def test_a_serving_command_stops_on_a_signal_and_exits_0(database_url: str, args: list[str], said: str,
                                                              signum: signal.Signals) -> None:
    # `external serve` left the signal to uvicorn, which re-raised it after its shutdown: SIGTERM killed the
    # process (143) and SIGINT ended as click's "Aborted!" with exit 1, as if something had gone wrong.
    proc = await spawn(*args, "--database-url", database_url)
    await proc.line_containing(said)
    proc.proc.send_signal(signum)
    assert await proc.exit_code(DEADLINE) == 0, "".join(proc.lines)
    assert "Aborted" not in "".join(proc.lines)
