"""Flow limits per scope: a limit is kept per (scope, workflow), as the start path has always counted it
(flow_on_start reads the limit of the instance's own scope). Before, set, remove and list knew only the
scope 'default', so a tenant's instances could not be limited at all."""

from __future__ import annotations

import asyncio
import json

import asyncpg
import pytest
from click.testing import CliRunner, Result

from stepstone.cli import cli
from stepstone.errors import InvalidInput
from stepstone.testing import Engine
from tests.scheduling.workflows import long


async def _statuses(engine: Engine, ids: list[str]) -> list[str]:
    return [(await engine.client.get(i)).status for i in ids]


async def test_a_limit_in_the_default_scope_holds_no_other_scopes_instances(engine: Engine) -> None:
    """What a single-scope user has: unchanged by the fix (it held before too)."""
    await engine.client.set_flow_limit(long, max_running=1)
    default = [await engine.client.start(long, {}) for _ in range(2)]
    tenant = [await engine.client.start(long, {}, scope="tenant-a") for _ in range(2)]
    await engine.run_until_idle()
    assert await _statuses(engine, default) == ["WAITING", "PENDING"]
    assert await _statuses(engine, tenant) == ["WAITING", "WAITING"]


async def test_a_limit_in_a_tenants_scope_holds_that_tenants_instances_only(
    engine: Engine, db: asyncpg.Connection,
) -> None:
    await engine.client.set_flow_limit(long, max_running=1, scope="tenant-a")
    assert await db.fetch("SELECT scope FROM stepstone.flow_limits") == [("tenant-a",)]
    tenant = [await engine.client.start(long, {}, scope="tenant-a") for _ in range(3)]
    other = [await engine.client.start(long, {}, scope="tenant-b") for _ in range(2)]
    default = [await engine.client.start(long, {}) for _ in range(2)]
    await engine.run_until_idle()
    assert await _statuses(engine, tenant) == ["WAITING", "PENDING", "PENDING"]
    assert await _statuses(engine, other + default) == ["WAITING"] * 4
    [info] = await engine.client.flow_limits()
    assert (info.scope, info.workflow, info.max_running, info.running, info.waiting) == ("tenant-a", "long", 1, 1, 2)
    assert await engine.client.flow_limits(scope="default") == []
    assert await engine.client.flow_limits(long, scope="tenant-a") == [info]
    # raising it admits in its own scope's buckets
    assert await engine.client.set_flow_limit(long, max_running=2, scope="tenant-a") == 1
    # removing the default scope's (none) leaves the tenant's alone; removing the tenant's releases its queue
    assert await engine.client.remove_flow_limit(long) == 0
    assert [i.scope for i in await engine.client.flow_limits()] == ["tenant-a"]
    assert await engine.client.remove_flow_limit(long, scope="tenant-a") == 1
    assert await engine.client.flow_limits() == []
    await engine.run_until_idle()
    assert await _statuses(engine, tenant) == ["WAITING"] * 3


async def test_the_same_workflow_limited_in_two_scopes_keeps_two_limits(engine: Engine) -> None:
    await engine.client.set_flow_limit(long, max_running=1)
    await engine.client.set_flow_limit(long, max_running=2, scope="tenant-a")
    listed = [(i.scope, i.workflow, i.max_running) for i in await engine.client.flow_limits(long)]
    assert listed == [("default", "long", 1), ("tenant-a", "long", 2)]


async def test_a_limit_takes_a_scope_name(engine: Engine) -> None:
    for bad in ("", "x" * 300):
        with pytest.raises(InvalidInput):
            await engine.client.set_flow_limit(long, max_running=1, scope=bad)
        with pytest.raises(InvalidInput):
            await engine.client.remove_flow_limit(long, scope=bad)
        with pytest.raises(InvalidInput):
            await engine.client.flow_limits(scope=bad)
    assert await engine.client.flow_limits() == []


async def test_the_cli_sets_lists_and_removes_a_scopes_limit(engine: Engine, database_url: str) -> None:
    def run(*args: str) -> Result:
        return CliRunner().invoke(cli, [*args, "--database-url", database_url])

    done = await asyncio.to_thread(run, "limits", "set", "long", "--max-running", "1", "--scope", "tenant-a")
    assert done.exit_code == 0, done.output
    assert done.stdout.strip() == "limit set on long in scope tenant-a"
    listed = await asyncio.to_thread(run, "limits", "list", "-o", "json")
    assert [(i["scope"], i["workflow"]) for i in json.loads(listed.stdout)] == [("tenant-a", "long")]
    assert json.loads((await asyncio.to_thread(run, "limits", "list", "--scope", "default", "-o", "json")).stdout) == []
    missing = await asyncio.to_thread(run, "limits", "remove", "long")  # the default scope's: there is none
    assert missing.exit_code != 0 and "no flow limit on 'long' (`stepstone" in missing.output
    missing = await asyncio.to_thread(run, "limits", "remove", "long", "--scope", "tenant-b")
    assert missing.exit_code != 0 and "no flow limit on 'long' in scope 'tenant-b'" in missing.output
    removed = await asyncio.to_thread(run, "limits", "remove", "long", "--scope", "tenant-a", "-o", "json")
    assert removed.exit_code == 0, removed.output
    assert json.loads(removed.stdout) == {"scope": "tenant-a", "workflow": "long", "released": 0}
    assert await engine.client.flow_limits() == []
