"""Migrating an instance that waits at a join: the join's need must not change under it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from click.testing import CliRunner
from pydantic import BaseModel

from stepstone.authoring.workflow import Registry, Retry, StepContext, Workflow
from stepstone.cli import cli
from stepstone.testing import Engine, open_engine


class Tri(BaseModel):
    fail: str = ""
    ran: str = ""


def _tri(version: int, need: int | str) -> Workflow[Tri]:
    """Three branches that each wait for "go", then run a step that fails when the state names it."""
    wf: Workflow[Tri] = Workflow("mig_need", version=version, state=Tri)
    wf.fork("split", branches={b: f"wait_{b}" for b in "pqr"}, start=True)
    for b in "pqr":
        wf.wait(f"wait_{b}", signals={"go": f"do_{b}"})

        async def run(_ctx: StepContext, state: Tri, b: str = b) -> None:
            if b in state.fail:
                raise RuntimeError(f"branch {b} fails")
            state.ran += b

        wf.step(name=f"do_{b}", next="joined", retry=Retry(max_attempts=1))(run)
    wf.join("joined", fork="split", next="fin", need=need)

    @wf.step
    async def fin(_ctx: StepContext, state: Tri) -> None:
        state.ran += f"/v{version}"

    return wf


two_v1, any_v2, all_v3, two_v4 = _tri(1, 2), _tri(2, "any"), _tri(3, "all"), _tri(4, 2)
registry = Registry(two_v1, any_v2, all_v3, two_v4)


@pytest.fixture
async def engine(database_url: str) -> Any:
    async with open_engine(database_url, registry) as e:
        yield e


async def _started(engine: Engine, fail: str = "") -> str:
    iid = await engine.client.start(two_v1, {"fail": fail})
    await engine.run_until_idle()
    return iid


@pytest.mark.parametrize(("target", "said"), [
    (any_v2, "join 'joined' needs 2 in v1 and any in v2: an instance waiting at it cannot move"),
    (all_v3, "join 'joined' needs 2 in v1 and all in v3: an instance waiting at it cannot move"),
])
async def test_a_join_whose_need_differs_in_the_target_is_refused(
        engine: Engine, target: Workflow[Tri], said: str) -> None:
    iid = await _started(engine, fail="r")
    await engine.client.signal(iid, "go", position="split/r")
    await engine.run_until_idle()  # r failed for good; need=2 passes over it: the instance waits
    assert (await engine.client.get(iid)).status == "WAITING"
    history = await engine.client.history(iid)
    dry = await engine.client.migrate([iid], to=target, dry_run=True)
    real = await engine.client.migrate([iid], to=target)
    for report in (dry, real):
        assert report.counts == {"refused": 1}
        assert said in report.outcomes[0].reason, report
    assert (await engine.client.get(iid)).version == 1
    assert await engine.client.history(iid) == history
    for b in "pq":  # still v1's join: two of three, and the failed one is passed over
        await engine.client.signal(iid, "go", position=f"split/{b}")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.version, info.state["ran"]) == ("COMPLETED", 1, "pq/v1")


async def test_a_join_with_the_same_need_migrates(engine: Engine) -> None:
    iid = await _started(engine)
    report = await engine.client.migrate([iid], to=two_v4)
    assert report.counts == {"migrated": 1}
    for b in "qr":
        await engine.client.signal(iid, "go", position=f"split/{b}")
    await engine.run_until_idle()
    info = await engine.client.get(iid)
    assert (info.status, info.version, info.state["ran"]) == ("COMPLETED", 4, "qr/v4")


@pytest.mark.parametrize("dry_run", [True, False])
async def test_the_cli_exits_4_when_an_instance_is_refused(engine: Engine, database_url: str, dry_run: bool) -> None:
    refused, ended = await _started(engine), await _started(engine)
    await engine.client.signal(ended, "go", position="split/p")
    await engine.client.signal(ended, "go", position="split/q")
    await engine.run_until_idle()  # its join fired and it completed
    args = ["definitions", "migrate", "--app", "tests.registry.test_migration_joins:registry", "--workflow",
            "mig_need", "--to-version", "2", *(["--dry-run"] if dry_run else []), "-o", "json",
            "--database-url", database_url]
    result = await asyncio.to_thread(CliRunner().invoke, cli, [*args, ended, refused])
    assert result.exit_code == 4, result.output
    report = json.loads(result.stdout)
    assert report["counts"] == {"refused": 1, "skipped": 1}, report
    assert "needs 2 in v1 and any in v2" in report["instances"][1]["reason"]
    assert (await engine.client.get(refused)).version == 1
    result = await asyncio.to_thread(CliRunner().invoke, cli, [*args, ended])
    assert (result.exit_code, json.loads(result.stdout)["counts"]) == (0, {"skipped": 1}), result.output
