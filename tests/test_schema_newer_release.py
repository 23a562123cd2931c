"""A schema a newer release has migrated further: this release runs on it (migrations only add), as the
workers of the release before do through a rolling deploy whose migration Job ran first, and as they do
again after a rollback (docs/deploy.md). A history that lacks a shipped version is still refused."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal

import asyncpg
import pytest
from click.testing import CliRunner

from stepstone.cli import cli
from stepstone.client import Client
from stepstone.errors import SchemaTooNew
from tests.observability.test_metrics_health import _get
from tests.test_cli_worker import DEADLINE, start_worker

NEXT = 9999  # a version this stepstone does not ship: a newer release's migration


async def record(url: str, statement: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


@pytest.fixture
async def newer(database_url: str) -> str:
    await record(database_url, "INSERT INTO stepstone.schema_migrations (version, name, checksum) "
                               f"VALUES ({NEXT}, 'next_release', 'x')")
    return database_url


async def test_a_client_connects_to_a_newer_schema_and_says_so(newer: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="stepstone.store"):
        client = await Client.connect(newer)
    try:
        assert await client.list() == []
    finally:
        await client.close()
    said = [r.getMessage() for r in caplog.records if str(NEXT) in r.getMessage()]
    assert len(said) == 1 and "newer stepstone" in said[0], said


def test_the_cli_runs_on_a_newer_schema(newer: str) -> None:
    runner = CliRunner()
    migrated = runner.invoke(cli, ["db", "migrate", "--database-url", newer])
    assert migrated.exit_code == 0, migrated.output
    assert "nothing to apply" in migrated.stdout and str(NEXT) in migrated.stdout
    found = runner.invoke(cli, ["find", "--database-url", newer, "-o", "json"])
    assert found.exit_code == 0, found.output
    assert json.loads(found.stdout)["instances"] == []
    doctor = runner.invoke(cli, ["doctor", "--database-url", newer, "-o", "json"])
    assert doctor.exit_code == 0, doctor.output
    report = json.loads(doctor.stdout)
    assert report["problems"] == [] and report["schema"]["unknown"] == [NEXT]
    assert any("newer stepstone" in w for w in report["warnings"]), report["warnings"]


async def test_a_worker_starts_on_a_newer_schema_and_is_ready(newer: str) -> None:
    worker = await start_worker(newer, "--metrics-port", "0", "--metrics-host", "127.0.0.1", "--log-format", "json")
    try:
        warning = json.loads(await worker.line_containing("newer stepstone"))
        assert warning["level"] == "warning" and str(NEXT) in warning["message"]
        line = await worker.line_containing("health and metrics on")
        match = re.search(r":(\d+) \(", json.loads(line)["message"])
        assert match is not None, line
        status, body = await _get(int(match.group(1)), "/readyz")
        assert (status, json.loads(body)["checks"]["schema"]) == (200, True), body
    finally:
        worker.proc.send_signal(signal.SIGTERM)
        assert await worker.exit_code(DEADLINE) == 0, "".join(worker.lines)


def test_a_history_without_a_shipped_version_is_still_refused(newer: str) -> None:
    asyncio.run(record(newer, "DELETE FROM stepstone.schema_migrations WHERE version = 2"))
    with pytest.raises(SchemaTooNew, match=str(NEXT)):
        asyncio.run(Client.connect(newer))
    result = CliRunner().invoke(cli, ["db", "migrate", "--database-url", newer])
    assert result.exit_code == 1 and "upgrade stepstone" in result.stderr, result.output
