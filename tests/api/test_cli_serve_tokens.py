"""``stepstone tokens create | list | revoke`` and ``stepstone serve``'s loopback rule."""

from __future__ import annotations

import asyncio
import json
import socket
from datetime import datetime

import httpx
import pytest
from click.testing import CliRunner

from stepstone.api.binding import check_bind, is_loopback
from stepstone.cli import cli
from stepstone.client import Client
from stepstone.errors import ConfigError, InvalidInput
from stepstone.store.postgres import PostgresStore
from tests.api import workflows
from tests.registry.test_documents import APPROVAL  # the approval document of docs/versions.md
from tests.test_cli_worker import spawn


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_the_bind_rule() -> None:
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"):
        assert is_loopback(host)
        check_bind(host, auth=False, active_tokens=0)
    for host in ("0.0.0.0", "::", "192.0.2.10", "example.org"):  # noqa: S104 - the addresses refused
        assert not is_loopback(host)
        with pytest.raises(ConfigError, match="--no-auth is for a loopback address only"):
            check_bind(host, auth=False, active_tokens=5)
        with pytest.raises(ConfigError, match="no API token exists"):
            check_bind(host, auth=True, active_tokens=0)
        check_bind(host, auth=True, active_tokens=1)


async def test_tokens_create_list_revoke(database_url: str) -> None:
    url = ["--database-url", database_url]
    code, out, err = await asyncio.to_thread(invoke, "tokens", "create", "--role", "operator", "--scope", "acme",
                                             "--name", "deploy", "--group", "finance", "--group", "ops", *url)
    assert code == 0, err
    token = out.strip()
    assert token.startswith("sst_") and len(token) > 40
    assert "role operator in scope acme" in err and "shown only now" in err
    code, out, _ = await asyncio.to_thread(invoke, "tokens", "list", "-o", "json", *url)
    [listed] = json.loads(out)
    assert (listed["name"], listed["role"], listed["scope"], listed["revoked_at"]) == ("deploy", "operator", "acme",
                                                                                      None)
    assert listed["groups"] == ["finance", "ops"]
    assert "T" in listed["created_at"] and datetime.fromisoformat(listed["created_at"]).tzinfo is not None
    assert token not in out
    code, out, _ = await asyncio.to_thread(invoke, "tokens", "revoke", listed["id"], *url)
    assert (code, out.strip()) == (0, f"revoked deploy ({listed['id']})")
    assert json.loads((await asyncio.to_thread(invoke, "tokens", "list", "-o", "json", *url))[1]) == []
    code, _, err = await asyncio.to_thread(invoke, "tokens", "revoke", "not-an-id", *url)
    assert (code, err.strip()) == (1, "error: no API token not-an-id")
    code, _, err = await asyncio.to_thread(invoke, "tokens", "create", "--role", "root", *url)
    assert code == 2 and "'root' is not one of" in err


async def test_a_token_name_or_scope_that_would_mislead_is_refused(database_url: str) -> None:
    """A name with a newline was stored and forged a row of `tokens list`; `--scope ' acme'` was stored
    with its space, a token that silently saw nothing. Both are refused, as an instance's scope is."""
    url = ["--database-url", database_url]
    for option, value in (("--name", "evil\nFAKE-ROW admin *"), ("--scope", " acme"), ("--scope", "acme\t"),
                          ("--group", "ops\r"), ("--name", "a\u2028b")):
        code, out, err = await asyncio.to_thread(invoke, "tokens", "create", "--role", "viewer", option, value, *url)
        what = option.removeprefix("--")
        assert code == 1 and out == "", err
        assert err.startswith(f"error: token {what}: ") and ("control character" in err or "spaces around" in err)
    assert json.loads((await asyncio.to_thread(invoke, "tokens", "list", "-o", "json", *url))[1]) == []
    store = await PostgresStore.open(database_url)
    try:
        with pytest.raises(InvalidInput, match="scope ' acme' is not a scope name"):  # core.pin.check_scope
            await Client(store, workflows.registry).start("job", {"name": "x"}, scope=" acme")
    finally:
        await store.close()


def test_serve_refuses_no_auth_off_loopback_before_connecting() -> None:
    code, _, err = invoke("serve", "--host", "0.0.0.0", "--no-auth", "--database-url",  # noqa: S104 - the point
                          "postgresql://nobody@127.0.0.1:1/none")
    assert code == 1
    assert err.strip() == ("error: refusing to serve on 0.0.0.0 without authentication: --no-auth is for a "
                           "loopback address only (e.g. --host 127.0.0.1)")


def test_serve_refuses_a_public_address_without_any_token(database_url: str) -> None:
    code, _, err = invoke("serve", "--host", "0.0.0.0", "--database-url", database_url)  # noqa: S104
    assert code == 1
    assert "no API token exists, so nobody could sign in" in err


def free_port() -> int:
    with socket.socket() as probe:  # a free port (a race with another process is unlikely and would fail loudly)
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_an_address_that_cannot_be_taken_is_one_line(database_url: str) -> None:
    """uvicorn exits the process when it cannot bind (SystemExit 3, with a traceback), and the worker's
    probe port raised the socket's OSError; both are bound by stepstone now, and say why in one line."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err = invoke("serve", "--no-auth", "--port", str(port), "--database-url", database_url)
        assert (code, err.strip()) == (1, f"error: cannot listen on 127.0.0.1:{port}: Address already in use")
        code, _, err = invoke("worker", "--app", "tests.api.workflows:registry", "--metrics-host", "127.0.0.1",
                              "--metrics-port", str(port), "--database-url", database_url)
        line = err.strip().splitlines()[-1]
        assert code == 1 and line.startswith(f"error: cannot listen on 127.0.0.1:{port} for health and metrics: ")
        assert "address already in use" in line.lower(), err


async def test_serve_answers_on_loopback_and_needs_a_token(database_url: str) -> None:
    port = free_port()
    proc = await spawn("serve", "--port", str(port), "--read-only", env={"STEPSTONE_DATABASE_URL": database_url})
    try:
        await proc.line_containing(f"serving http://127.0.0.1:{port}/ui/")  # logged once uvicorn listens
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/api/v1", timeout=10) as http:
            assert (await http.get("/health")).json() == {"status": "ok", "read_only": True}
            assert (await http.get("/instances")).status_code == 401
            assert (await http.post("/instances", json={})).status_code == 405
    finally:
        if proc.proc.returncode is None:
            proc.proc.terminate()
    assert await proc.exit_code(timeout=20) == 0, "".join(proc.lines)
    assert "no API token exists yet" in "".join(proc.lines)


async def test_worker_serve_runs_the_workflows_and_the_api_in_one_process(database_url: str) -> None:
    port = free_port()
    proc = await spawn("worker", "--app", "tests.api.workflows:registry", "--serve", "--no-auth", "--port", str(port),
                       "--catalog", "stepstone.examples.document_catalog:catalog",
                       env={"STEPSTONE_DATABASE_URL": database_url})
    store = await PostgresStore.open(database_url)
    client = Client(store, workflows.registry)
    try:
        await proc.line_containing("serving http://127.0.0.1")
        await proc.line_containing("started: concurrency")  # the worker, after the API it serves beside
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/api/v1", timeout=10) as http:
            iid = (await http.post("/instances", json={"workflow": "job", "input": {"name": "w"}})).json()["id"]
            # Parked until the instance reaches its approval wait, which the worker runs it to.
            assert (await http.post(f"/instances/{iid}/signals", json={"name": "approve"})).status_code == 202
            done = await client.wait_for(iid, timeout=30)  # wakes on the instance's settle notification
            assert (done.status, done.state["log"]) == ("COMPLETED", ["charged", "shipped"])
            history = (await http.get(f"/instances/{iid}/history")).json()["items"]
            assert history[0]["actor"]["id"] == "local"
            # --catalog reaches the API served here: a document's handlers are checked against it.
            checked = await http.post("/definitions/validate", json={"document": APPROVAL})
            assert checked.status_code == 200 and checked.json()["handlers_checked"] is True, checked.text
    finally:
        await client.detach()
        await store.close()
        if proc.proc.returncode is None:
            proc.proc.terminate()
    assert await proc.exit_code(timeout=30) == 0, "".join(proc.lines)
    assert "drained" in "".join(proc.lines)


def test_worker_serve_refuses_no_auth_off_loopback() -> None:
    code, _, err = invoke("worker", "--app", "tests.api.workflows:registry", "--serve", "--no-auth",
                          "--host", "0.0.0.0", "--database-url", "postgresql://nobody@127.0.0.1:1/none")  # noqa: S104
    assert code == 1 and "--no-auth is for a loopback address only" in err
