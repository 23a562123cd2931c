"""`stepstone definitions stranded` says when a pin was last served only when it knows: a worker that stops
cleanly deletes its heartbeat rows (`forget_worker`), so the report cannot tell "served a minute ago" from
"never served" and says `unknown`, not `never`."""

from __future__ import annotations

import asyncio
import json

from click.testing import CliRunner

from stepstone.cli import cli
from stepstone.core.pin import pin_of
from stepstone.store.postgres import PostgresStore
from tests import cli_apps


async def _served_then_stopped_cleanly(url: str) -> None:
    store = await PostgresStore.open(url)
    try:
        await store.definitions.heartbeat("w1", [pin_of(cli_apps.approval)])
        await store.definitions.forget_worker("w1")  # what Worker.stop does
    finally:
        await store.close()


def test_a_pin_whose_worker_stopped_cleanly_is_not_said_never_served(database_url: str) -> None:
    runner = CliRunner()
    db = ["--database-url", database_url]
    started = runner.invoke(cli, ["start", "approval", "--app", "tests.cli_apps:registry", *db])
    assert started.exit_code == 0, started.output
    asyncio.run(_served_then_stopped_cleanly(database_url))
    table = runner.invoke(cli, ["definitions", "stranded", *db])
    assert table.exit_code == 0, table.output
    [row] = [line for line in table.stdout.splitlines() if line.startswith("approval")]
    assert row.split()[-1] == "unknown" and "never" not in table.stdout, table.stdout
    data = json.loads(runner.invoke(cli, ["definitions", "stranded", "-o", "json", *db]).stdout)
    assert [(r["workflow"], r["last_served"]) for r in data] == [("approval", None)]
