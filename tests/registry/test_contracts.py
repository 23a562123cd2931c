"""Contract checks against the version pinned in the instance's scope: declared signals and messages."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.errors import UnknownSignal
from stepstone.testing import Engine, open_engine


def contract(version: int, signals: tuple[str, ...], messages: tuple[str, ...] = ()) -> Workflow[Any]:
    wf: Workflow[Any] = Workflow("contract", version=version)
    wf.wait("w", signals=dict.fromkeys(signals, "end"), messages=dict.fromkeys(messages, "end") or None,
            correlation="order" if messages else None, start=True)

    @wf.step
    async def end(_ctx: StepContext, state: dict[str, Any]) -> None:
        state["version"] = version

    return wf


C1, C2 = contract(1, ("go",)), contract(2, ("go", "stop"), ("paid",))


@pytest.fixture
async def engine(database_url: str) -> Any:
    async with open_engine(database_url, Registry(C1, C2)) as e:
        yield e


async def _commands(engine: Engine, iid: str) -> int:
    pool = engine.store.pool  # type: ignore[attr-defined]
    return int(await pool.fetchval("SELECT count(*) FROM stepstone.commands WHERE instance_id = $1", uuid.UUID(iid)))


async def test_a_signal_the_pinned_version_does_not_declare_is_refused_naming_scope_and_version(
    engine: Engine,
) -> None:
    iid = await engine.client.start(C1, {"order": "o-1"}, scope="acme")
    await engine.run_until_idle()
    before = await _commands(engine, iid)
    with pytest.raises(UnknownSignal) as refused:
        await engine.client.signal(iid, "stop")  # v2 declares it; the instance is pinned to v1
    err = refused.value
    assert (err.scope, err.definition_id, err.version, err.declared) == ("default", "contract", 1, ("go",))
    assert str(err) == (f"instance {iid} has no signal named 'stop' in its pinned version: workflow 'contract' v1 "
                        "of scope default declares go")
    assert await _commands(engine, iid) == before  # nothing was recorded
    await engine.client.migrate(iid, to=C2)
    await engine.client.signal(iid, "stop")  # now pinned to v2, which declares it
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).state["version"] == 2


async def test_the_registry_records_each_versions_declared_signals_and_messages(engine: Engine) -> None:
    rows = {r["version"]: r for r in [await engine.store.definitions.find("default", "contract", v) for v in (1, 2)]}
    assert (list(rows[1]["signal_names"]), list(rows[1]["message_names"])) == (["go"], [])
    assert (list(rows[2]["signal_names"]), list(rows[2]["message_names"])) == (["go", "stop"], ["paid"])
