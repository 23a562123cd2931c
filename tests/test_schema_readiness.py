"""A client or worker on an unmigrated schema: a typed SchemaNotReady on a configured database (never
migrated implicitly); on the embedded default, migrated on the spot with one line saying so."""

from __future__ import annotations

import asyncio
import logging

import asyncpg
import pytest
from click.testing import CliRunner

from stepstone.cli import cli
from stepstone.client import Client
from stepstone.errors import ConfigError, DatabaseError, SchemaNotReady
from stepstone.runtime.worker import Worker
from stepstone.store.database import DatabaseTarget
from stepstone.store.postgres import PostgresStore
from tests import cli_apps


async def tables(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return int(await conn.fetchval(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'stepstone'"))
    finally:
        await conn.close()


async def test_connect_on_an_unmigrated_configured_database_is_schema_not_ready(empty_database_url: str) -> None:
    with pytest.raises(SchemaNotReady, match=r"run `stepstone db migrate` first") as caught:
        await Client.connect(empty_database_url)
    assert isinstance(caught.value, ConfigError) and isinstance(caught.value, DatabaseError)
    assert caught.value.schema == "stepstone"
    assert caught.value.pending
    assert "\n" not in str(caught.value)
    assert await tables(empty_database_url) == 0  # nothing was migrated


async def test_connect_on_the_configured_database_from_the_environment(
    empty_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STEPSTONE_DATABASE_URL", empty_database_url)
    with pytest.raises(SchemaNotReady):
        await Client.connect()
    assert await tables(empty_database_url) == 0


async def test_connect_on_a_migrated_database_works(database_url: str) -> None:
    client = await Client.connect(database_url)
    try:
        assert await client.list() == []
    finally:
        await client.close()


def embedded_at(url: str) -> DatabaseTarget:
    return DatabaseTarget(url=url, embedded=True)


async def test_connect_on_the_embedded_default_migrates_it(
    empty_database_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("stepstone.store.factory.resolve_target", lambda *_a, **_k: embedded_at(empty_database_url))
    with caplog.at_level(logging.INFO, logger="stepstone"):
        client = await Client.connect()
    try:
        assert await client.list() == []
    finally:
        await client.close()
    said = [r.getMessage() for r in caplog.records if "migrated" in r.getMessage()]
    assert len(said) == 1 and "embedded" in said[0] and "0001_initial" in said[0], said
    assert await tables(empty_database_url) > 0


def test_cli_on_the_embedded_default_migrates_it(empty_database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("stepstone.cli.connection.resolve_target", lambda *_a, **_k: embedded_at(empty_database_url))
    result = CliRunner().invoke(cli, ["list"])
    assert result.exit_code == 0, result.output
    assert "no instances" in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "migrated the embedded development database" in lines[0], result.stderr
    assert asyncio.run(tables(empty_database_url)) > 0


def test_cli_on_an_unmigrated_configured_database_says_to_migrate(empty_database_url: str) -> None:
    result = CliRunner().invoke(cli, ["list", "--database-url", empty_database_url])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        result.stderr.strip()] and "run `stepstone db migrate` first" in result.stderr
    assert asyncio.run(tables(empty_database_url)) == 0


async def test_a_worker_on_an_unmigrated_schema_is_schema_not_ready(empty_database_url: str) -> None:
    store = await PostgresStore.open(empty_database_url)
    try:
        with pytest.raises(SchemaNotReady, match=r"run `stepstone db migrate` first"):
            await Worker(store, cli_apps.registry).start()
        with pytest.raises(SchemaNotReady):
            await Client(store, cli_apps.registry).list()
    finally:
        await store.close()
    assert await tables(empty_database_url) == 0
