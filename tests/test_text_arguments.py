"""Every text argument of every operation gets the same check (NUL, lone surrogates, undecodable bytes,
length) before anything reaches the driver: a typed InvalidInput from `Client`, one line from the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from click.testing import CliRunner

from stepstone.cli import cli
from stepstone.client import Client
from stepstone.errors import InvalidInput, PayloadTooLarge
from stepstone.ops import InstanceFilter, Operations
from stepstone.store.factory import operations_store
from stepstone.store.postgres import PostgresStore
from tests import cli_apps

APP = "tests.cli_apps:registry"
BAD = {"nul": "a\x00b", "surrogate": "a\ud800b", "undecodable": "r\udcffr"}  # the last: b"r\xffr" on argv


@pytest.fixture
async def client(database_url: str) -> AsyncIterator[Client]:
    store = await PostgresStore.open(database_url)
    client = Client(store, cli_apps.registry)
    try:
        yield client
    finally:
        await store.close()


async def started(client: Client) -> str:
    return await client.start("approval")


OPERATIONS: dict[str, Callable[[Client, str, str], Awaitable[Any]]] = {
    "cancel reason": lambda c, iid, bad: c.cancel(iid, bad),
    "list business key": lambda c, _, bad: c.list(business_key=bad),
    "list workflow": lambda c, _, bad: c.list(definition=bad),
    "list status": lambda c, _, bad: c.list(status=bad),
    "signal name": lambda c, iid, bad: c.signal(iid, bad),
    "dedup key": lambda c, iid, bad: c.signal(iid, "approve", dedup_key=bad),
    "start business key": lambda c, _, bad: c.start("approval", business_key=bad),
    "start idempotency key": lambda c, _, bad: c.start("approval", idempotency_key=bad),
    "start workflow name": lambda c, _, bad: c.start(bad),
    "get": lambda c, _, bad: c.get(bad),
    "history": lambda c, _, bad: c.history(bad),
    "retry": lambda c, _, bad: c.retry(bad),
    "wait_for": lambda c, _, bad: c.wait_for(bad, timeout=0.01),
    "schedules": lambda c, _, bad: c.schedules(bad),
    "pause schedule": lambda c, _, bad: c.pause_schedule(bad),
    "resume schedule": lambda c, _, bad: c.resume_schedule(bad),
    "delete schedule": lambda c, _, bad: c.delete_schedule(bad),
    "trigger schedule": lambda c, _, bad: c.trigger_schedule(bad),
    "flow limits workflow": lambda c, _, bad: c.flow_limits(bad),
    "remove flow limit": lambda c, _, bad: c.remove_flow_limit(bad),
}


@pytest.mark.parametrize("kind", list(BAD))
@pytest.mark.parametrize("operation", list(OPERATIONS))
async def test_client_refuses_bad_text_with_a_typed_error(client: Client, operation: str, kind: str) -> None:
    instance_id = await started(client)
    with pytest.raises(InvalidInput) as caught:
        await OPERATIONS[operation](client, instance_id, BAD[kind])
    assert "\n" not in str(caught.value)
    assert caught.value.what is not None
    assert (await client.get(instance_id)).status == "PENDING"  # nothing was done to it


async def test_length_is_bounded_for_free_text_too(client: Client) -> None:
    instance_id = await started(client)
    with pytest.raises(PayloadTooLarge, match="cancel reason"):
        await client.cancel(instance_id, "x" * (client.limits.max_text_length + 1))
    with pytest.raises(PayloadTooLarge, match="business key"):
        await client.list(business_key="k" * (client.limits.max_name_length + 1))
    assert await client.cancel(instance_id, "a fine reason, ünïcode included") == "CANCELLED"


async def test_numbers_past_what_a_column_holds_are_taken_within_it(client: Client) -> None:
    """A page's size and a history cursor past int8/int4 reached the driver ("value out of int64 range")."""
    instance_id = await started(client)
    assert [r["id"] for r in await client.list(limit=2**63)] == [instance_id]
    page = await client.history_page(instance_id, after=2**31, limit=2**63)
    assert (page.entries, page.next_after) == ([], None)
    workflow = cli_apps.registry.latest("approval")
    assert workflow is not None
    assert await client.flow_limits(workflow) == []  # a workflow, as set_flow_limit takes it: was the driver's error


OPS_OPERATIONS: dict[str, Callable[[Operations, str, str], Awaitable[Any]]] = {
    "retention policy workflow": lambda o, _, bad: o.set_retention_policy(bad, "completed", None),
    "retention sweep scope": lambda o, _, bad: o.retention_run(dry_run=True, scope=bad),
    "find workflow": lambda o, _, bad: o.find(InstanceFilter(workflow=bad)),
    "count business key": lambda o, _, bad: o.count(InstanceFilter(business_key_contains=bad)),
    "cancel reason": lambda o, iid, bad: o.cancel([iid], reason=bad),
    "cancel filter status": lambda o, _, bad: o.cancel(where=InstanceFilter(status=(bad,))),
    "replay step": lambda o, iid, bad: o.replay(iid, bad),
    "probe instance": lambda o, _, bad: o.probe(bad),
}


@pytest.mark.parametrize("kind", list(BAD))
@pytest.mark.parametrize("operation", list(OPS_OPERATIONS))
async def test_operations_refuse_bad_text_with_a_typed_error(client: Client, operation: str, kind: str) -> None:
    instance_id = await started(client)
    with pytest.raises(InvalidInput) as caught:
        await OPS_OPERATIONS[operation](Operations.on(client.store), instance_id, BAD[kind])
    assert caught.value.what is not None
    assert (await client.get(instance_id)).status == "PENDING"


async def test_a_nul_that_reaches_a_statement_is_refused_at_the_store_boundary(client: Client) -> None:
    """The net under a path that skipped the check: the driver's SQLSTATE 22021 becomes InvalidInput."""
    with pytest.raises(InvalidInput, match="cannot store"):
        await operations_store(client.store).set_retention_policy("a\x00b", "completed", None, None)


def test_client_refuses_a_bad_actor(client: Client) -> None:
    with pytest.raises(InvalidInput, match="actor"):
        Client(client.store, actor="ops\x00")


CLI_CASES = [
    ("cancel", "{id}", "--reason", "{bad}"),
    ("list", "--business-key", "{bad}"),
    ("list", "--workflow", "{bad}"),
    ("signal", "{id}", "{bad}"),
    ("signal", "{id}", "approve", "--dedup-key", "{bad}"),
    ("start", "{bad}", "--app", APP),
    ("start", "approval", "--business-key", "{bad}", "--app", APP),
    ("start", "approval", "--idempotency-key", "{bad}", "--app", APP),
]


@pytest.fixture
def instance_id(database_url: str) -> str:
    result = CliRunner().invoke(cli, ["start", "approval", "--app", APP, "--database-url", database_url])
    assert result.exit_code == 0, result.output
    return result.stdout.strip()


@pytest.mark.parametrize("kind", list(BAD))
@pytest.mark.parametrize("case", CLI_CASES, ids=lambda c: "-".join(a for a in c if "{" not in a))
def test_cli_prints_one_line_for_bad_text(database_url: str, instance_id: str, case: tuple[str, ...],
                                          kind: str) -> None:
    args = [a.format(id=instance_id, bad=BAD[kind]) for a in case]
    result = CliRunner().invoke(cli, [*args, "--database-url", database_url])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_undecodable_bytes_on_a_real_command_line(database_url: str, instance_id: str) -> None:
    """The bytes as a shell passes them (`--reason $'r\\xffr'`), through `python -m stepstone`."""
    env = {**os.environ, "PYTHONUTF8": "0", "LC_ALL": "C.UTF-8"}
    for argv in ([b"cancel", instance_id.encode(), b"--reason", b"r\xffr"], [b"list", b"--business-key", b"b\xff"],
                 [b"list", b"--workflow", b"w\xff"]):
        result = subprocess.run([sys.executable.encode(), b"-m", b"stepstone", *argv,
                                 b"--database-url", database_url.encode()],
                                capture_output=True, env=env, timeout=60, check=False)
        err = result.stderr.decode("utf-8", "replace").strip().splitlines()
        assert result.returncode == 1, err
        assert len(err) == 1 and "not valid UTF-8" in err[0], err
