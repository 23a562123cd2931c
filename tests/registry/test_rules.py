"""Registry rules checked where the other tests do not reach: retirement with a failed instance, the
digest on every read of a document (a worker loading published documents, `definitions show`)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from click.testing import CliRunner

from stepstone.authoring.documents import Catalog
from stepstone.authoring.workflow import Registry, Retry, StepContext, Workflow
from stepstone.cli import cli
from stepstone.errors import DocumentTampered, InvalidTransition
from stepstone.ops.definitions import load_published, publish_document
from stepstone.testing import open_engine

fragile: Workflow[Any] = Workflow("fragile", version=1)


@fragile.step(start=True, retry=Retry(max_attempts=1))
async def boom(_ctx: StepContext, state: dict[str, Any]) -> None:
    if not state.get("fixed"):
        raise RuntimeError("not yet")


async def test_a_version_a_failed_instance_pins_cannot_be_retired_until_it_is_retried(database_url: str) -> None:
    async with open_engine(database_url, Registry(fragile)) as engine:
        d = engine.store.definitions
        iid = await engine.client.start(fragile, {})
        await engine.run_until_idle()
        assert (await engine.client.get(iid)).status == "FAILED"  # a retry runs it again on its pinned version
        await d.deactivate("default", "fragile")
        await d.transition("default", "fragile", 1, "DEPRECATED")
        with pytest.raises(InvalidTransition, match="still pins 1 instance"):
            await d.transition("default", "fragile", 1, "RETIRED")
        await engine.client.cancel(iid)
        assert await d.transition("default", "fragile", 1, "RETIRED") == "DEPRECATED"


DOC = """\
id: tiny
version: 1
steps:
  - {name: only, kind: action, handler: noop, start: true}
"""
catalog = Catalog()


@catalog.handler("noop")
def noop(_ctx: StepContext, _state: dict[str, Any]) -> None:
    return None


async def _publish_and_tamper(database_url: str) -> None:
    async with open_engine(database_url, Registry()) as engine:
        await publish_document(engine.store.definitions, DOC, catalog)
        assert [w.id for w in await load_published(engine.store.definitions, catalog)] == ["tiny"]
        await engine.store.pool.execute(  # type: ignore[attr-defined]
            "UPDATE stepstone.definitions SET document = replace(document, 'noop', 'nope') "
            "WHERE definition_id = 'tiny'")
        with pytest.raises(DocumentTampered, match="no longer matches its SHA-256 digest"):
            await engine.store.definitions.document("default", "tiny", 1)
        assert await load_published(engine.store.definitions, catalog) == []  # what a worker loads is checked too


def test_a_tampered_document_is_never_loaded_nor_shown(database_url: str) -> None:
    """Sync: the CLI runs its own event loop, so the async part runs first in one of its own."""
    asyncio.run(_publish_and_tamper(database_url))
    shown = CliRunner().invoke(cli, ["definitions", "show", "tiny", "1", "--database-url", database_url])
    assert shown.exit_code != 0
    assert "no longer matches its SHA-256 digest" in shown.stderr and "Traceback" not in shown.stderr
    assert "nope" not in shown.stdout
