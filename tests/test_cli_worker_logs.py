"""`stepstone worker`'s log lines: the handlers' own loggers go through the worker's format (json or text),
at INFO and above, with the step they ran in; a failing step and instance are logged."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator

import pytest

from stepstone.client import Client
from stepstone.store.postgres import PostgresStore
from tests import cli_logging_app
from tests.test_cli_worker import DEADLINE, WorkerProcess, spawn


@pytest.fixture
async def client(database_url: str) -> AsyncIterator[Client]:
    store = await PostgresStore.open(database_url)
    client = Client(store, cli_logging_app.registry)
    yield client
    await client.detach()
    await store.close()


async def _worker(database_url: str, log_format: str) -> WorkerProcess:
    worker = await spawn("worker", "--app", "tests.cli_logging_app:registry", "--database-url", database_url,
                         "--poll-interval", "0.2", "--log-format", log_format)
    await worker.line_containing("started")
    return worker


async def _stop(worker: WorkerProcess) -> str:
    worker.proc.send_signal(signal.SIGTERM)
    assert await worker.exit_code(DEADLINE) == 0
    return "".join(worker.lines)


async def test_json_carries_the_handlers_own_lines_with_their_step(database_url: str, client: Client) -> None:
    worker = await _worker(database_url, "json")
    try:
        iid = await client.start("chatty", {})
        info = json.loads(await worker.line_containing(f"charging the card of {iid}"))
        warning = json.loads(await worker.line_containing(f"the card of {iid} is slow"))
        assert (await client.wait_for(iid, timeout=DEADLINE)).status == "COMPLETED"
    finally:
        out = await _stop(worker)
    context = {"workflow": "chatty", "instance": iid, "position": "", "step": "charge", "attempt": 1}
    assert info == {**info, "level": "info", "logger": "chatty_app", **context}
    assert warning == {**warning, "level": "warning", "logger": "chatty_app", **context}
    lines = [json.loads(raw) for raw in out.splitlines() if raw.strip()]  # every line is one JSON object
    assert not [line for line in lines if "never shown" in line["message"]]  # DEBUG is below the level


async def test_a_failing_instance_is_logged(database_url: str, client: Client) -> None:
    worker = await _worker(database_url, "json")
    try:
        iid = await client.start("doomed", {})
        retry = json.loads(await worker.line_containing("retrying in"))
        failed = json.loads(await worker.line_containing(f"instance {iid} failed at step decline"))
    finally:
        await _stop(worker)
    assert (retry["level"], retry["instance"], retry["attempt"]) == ("warning", iid, 1)
    assert (failed["level"], failed["instance"], failed["attempt"]) == ("error", iid, 2)
    assert "RuntimeError: the card was declined" in failed["message"]


async def test_text_carries_the_handlers_own_lines_with_their_step(database_url: str, client: Client) -> None:
    worker = await _worker(database_url, "text")
    try:
        iid = await client.start("chatty", {})
        info = await worker.line_containing(f"charging the card of {iid}")
        warning = await worker.line_containing(f"the card of {iid} is slow")
        assert (await client.wait_for(iid, timeout=DEADLINE)).status == "COMPLETED"
    finally:
        out = await _stop(worker)
    assert " INFO chatty_app: " in info and " WARNING chatty_app: " in warning
    # The fields in the documented order (docs/observability.md), as the worker's own failure lines have them.
    assert info.rstrip().endswith(f" [workflow=chatty instance={iid} step=charge attempt=1]"), info
    assert warning.rstrip().endswith(f" [workflow=chatty instance={iid} step=charge attempt=1]"), warning
    assert "never shown" not in out


async def test_the_served_api_logs_in_the_workers_format(database_url: str) -> None:
    # The HTTP server's own warnings (a request it cannot parse) came out in its own text format beside
    # the worker's JSON lines, which a log collector reading one object per line then choked on.
    worker = await spawn("worker", "--app", "tests.cli_logging_app:registry", "--database-url", database_url,
                         "--poll-interval", "0.2", "--log-format", "json", "--serve", "--port", "0", "--no-auth")
    try:
        serving = json.loads(await worker.line_containing("serving http://"))
        port = int(serving["message"].split("/ui/")[0].rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await reader.read()  # the server answers 400 and closes
        writer.close()
        warned = json.loads(await worker.line_containing("Invalid HTTP request"))
    finally:
        out = await _stop(worker)
    assert warned["level"] == "warning" and warned["logger"].startswith("uvicorn")
    lines = [json.loads(raw) for raw in out.splitlines() if raw.strip()]  # every line is one JSON object
    assert lines
