"""Hostile input: each value gets a clear typed error, nothing is stored and nothing crashes.

10,000-deep JSON, 3 MB payloads, NUL characters, lone surrogates, 1,001-character keys and names, and
schema names that are not identifiers, through the client API, the CLI and a handler's own output.
The bounds are `stepstone.core.limits.Limits` (documented in docs/guarantees.md, "Measured").
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from click.testing import CliRunner
from pydantic import BaseModel

from stepstone.authoring.workflow import Registry, Retry, StepContext, Workflow
from stepstone.cli import cli
from stepstone.client import Client
from stepstone.core.limits import Limits
from stepstone.errors import ConfigError, InvalidInput, PayloadTooDeep, PayloadTooLarge
from stepstone.store.postgres import PostgresStore
from stepstone.testing import open_engine


def deep(n: int) -> Any:
    doc: Any = 1
    for _ in range(n):
        doc = {"a": doc}
    return doc


class Free(BaseModel):
    data: Any = None


free: Workflow[Any] = Workflow("free", version=1)  # no state model: any JSON object
typed: Workflow[Free] = Workflow("typed", version=1, state=Free)


@free.step(start=True, next="w")
def first(ctx: StepContext, state: dict[str, Any]) -> None:
    """Takes the input as it is."""


free.wait("w", signals={"go": "end"})


@free.step(next=None)
def end(ctx: StepContext, state: dict[str, Any]) -> None:
    """Ends."""


@typed.step(start=True, next=None)
def only(ctx: StepContext, state: Free) -> None:
    """Ends."""


class Out(BaseModel):
    kind: str
    blob: Any = None


spews: Workflow[Out] = Workflow("spews", version=1, state=Out)


@spews.step(start=True, next=None, retry=Retry(max_attempts=1))
def spew(ctx: StepContext, state: Out) -> None:
    """A handler that produces hostile output: state or an event the store must not take."""
    hostile = HOSTILE_VALUES[state.kind]
    if state.kind.startswith("event"):
        ctx.emit("spew", hostile)
    else:
        state.blob = hostile


registry = Registry(free, typed, spews)

HOSTILE_VALUES: dict[str, Any] = {
    "deep": deep(10_000),
    "big": "x" * (3 * 1024 * 1024),
    "nul": "a\u0000b",
    "surrogate": "a\ud800b",
    "long_key": {"k" * 1001: 1},
    "nul_key": {"a\u0000": 1},
    "event_big": "x" * (3 * 1024 * 1024),
    "event_surrogate": "\udfff",
}

INPUTS: list[tuple[str, Any, type[Exception]]] = [
    ("deep", {"data": deep(10_000)}, PayloadTooDeep),
    ("big", {"data": "x" * (3 * 1024 * 1024)}, PayloadTooLarge),
    ("nul", {"data": "a\u0000b"}, InvalidInput),
    ("surrogate", {"data": "a\ud800b"}, InvalidInput),
    ("long_key", {"k" * 1001: 1}, PayloadTooLarge),
    ("nul_key", {"a\u0000": 1}, InvalidInput),
    ("surrogate_key", {"\udc00": 1}, InvalidInput),
]

NAMES: list[tuple[str, str]] = [
    ("long", "n" * 1001),
    ("nul", "a\u0000b"),
    ("surrogate", "a\ud800"),
]


@pytest.fixture
async def client(database_url: str) -> AsyncIterator[Client]:
    store = await PostgresStore.open(database_url, max_size=4)
    try:
        yield Client(store, registry)
    finally:
        await store.close()


async def _rows(client: Client) -> dict[str, int]:
    counts = {}
    for table in ("instances", "commands", "dedup", "history", "outbox"):
        counts[table] = await client.store.pool.fetchval(f"SELECT count(*) FROM stepstone.{table}")
    return counts


@pytest.mark.parametrize(("label", "value", "error"), INPUTS, ids=[i[0] for i in INPUTS])
@pytest.mark.parametrize("wf", [free, typed], ids=["untyped", "pydantic"])
async def test_start_rejects_hostile_input(
    client: Client, label: str, value: Any, error: type[Exception], wf: Workflow[Any]
) -> None:
    before = await _rows(client)
    if wf is typed and label in ("long_key", "nul_key", "surrogate_key"):
        value = {"data": value}  # the pydantic model takes the hostile dict as its field's value
    with pytest.raises(InvalidInput) as caught:
        await client.start(wf, value)
    assert isinstance(caught.value, error), caught.value
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 500
    assert await _rows(client) == before


@pytest.mark.parametrize(("label", "value", "error"), INPUTS, ids=[i[0] for i in INPUTS])
async def test_signal_rejects_hostile_payloads(client: Client, label: str, value: Any, error: type[Exception]) -> None:
    iid = await client.start(free, {})
    before = await _rows(client)
    with pytest.raises(error):
        await client.signal(iid, "go", value)
    assert await _rows(client) == before


@pytest.mark.parametrize(("label", "name"), NAMES, ids=[n[0] for n in NAMES])
async def test_keys_and_names_are_bounded(client: Client, label: str, name: str) -> None:
    iid = await client.start(free, {})
    before = await _rows(client)
    for call in (
        lambda: client.start(free, {}, idempotency_key=name),
        lambda: client.start(free, {}, business_key=name),
        lambda: client.signal(iid, name, None),
        lambda: client.signal(iid, "go", None, dedup_key=name),
    ):
        with pytest.raises(InvalidInput):
            await call()
    assert await _rows(client) == before


async def test_limits_are_configurable(database_url: str) -> None:
    store = await PostgresStore.open(database_url, max_size=2)
    try:
        tight = Client(store, registry, limits=Limits(max_payload_bytes=64, max_depth=3, max_name_length=8))
        with pytest.raises(PayloadTooLarge):
            await tight.start(free, {"data": "x" * 100})
        with pytest.raises(PayloadTooDeep):
            await tight.start(free, {"data": deep(5)})
        with pytest.raises(PayloadTooLarge):
            await tight.start(free, {}, idempotency_key="k" * 9)
        assert await tight.start(free, {"data": deep(1)}, idempotency_key="k" * 8)
    finally:
        await store.close()


@pytest.mark.parametrize("schema", ["a$$b", "o'brien", 'x";drop', "A", "", "x" * 64, "a\u0000"])
async def test_hostile_schema_names_are_refused(database_url: str, schema: str) -> None:
    with pytest.raises(ConfigError, match="invalid schema name"):
        await PostgresStore.open(database_url, schema)
    with pytest.raises(ConfigError, match="invalid schema name"):
        await Client.connect(database_url, schema=schema)


@pytest.mark.parametrize("kind", sorted(HOSTILE_VALUES))
async def test_hostile_handler_output_fails_the_instance_cleanly(database_url: str, kind: str) -> None:
    async with open_engine(database_url, registry, concurrency=1) as engine:
        iid = await engine.client.start(spews, {"kind": kind})
        await engine.run_until_idle()
        info = await engine.client.get(iid)
        assert info.status == "FAILED", info
        assert info.error["type"] in ("PayloadRejected", "InvalidState"), info.error
        assert info.state == {"kind": kind, "blob": None}  # the hostile state was not stored
        assert await engine.store.pool.fetchval("SELECT count(*) FROM stepstone.outbox") == 0


def _cli(url: str, *args: str, schema: str | None = None) -> Any:
    root = ["--schema", schema] if schema is not None else []
    return CliRunner().invoke(cli, [*root, *args, "--database-url", url], catch_exceptions=False)


CLI_INPUTS = [
    ("deep", '{"data": ' + '{"a": ' * 10_000 + "1" + "}" * 10_000 + "}"),
    ("deep_list", "[" * 10_000 + "]" * 10_000),
    ("big", json.dumps({"data": "x" * (3 * 1024 * 1024)})),
    ("nul", '{"data": "a\\u0000b"}'),
    ("surrogate", '{"data": "a\\ud800b"}'),
    ("long_key", json.dumps({"k" * 1001: 1})),
]


@pytest.mark.parametrize(("label", "text"), CLI_INPUTS, ids=[c[0] for c in CLI_INPUTS])
def test_cli_rejects_hostile_input(database_url: str, label: str, text: str) -> None:
    result = _cli(database_url, "start", "free", "--app", "tests.chaos.test_hostile_input:registry", "--input", text)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error"), result.stderr[:500]
    assert asyncio.run(_count(database_url)) == 0


async def _count(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM stepstone.instances"))
    finally:
        await conn.close()


@pytest.mark.parametrize("schema", ["a$$b", "o'brien", 'x";drop'])
def test_cli_refuses_hostile_schema_names(database_url: str, schema: str) -> None:
    result = _cli(database_url, "list", schema=schema)
    assert result.exit_code == 1, result.output
    assert "invalid schema name" in result.stderr
    assert "Traceback" not in result.output
