"""A version loaded from a document is recorded with its text by whichever door records it first, and a
publication of a version registered without its text stores the text."""

from __future__ import annotations

from stepstone.authoring.documents import load_document
from stepstone.authoring.workflow import Registry
from stepstone.core.pin import pin_of
from stepstone.ops.definitions import load_published, publish_document
from stepstone.testing import open_engine
from tests.registry.test_documents import APPROVAL, catalog


async def test_a_client_records_a_document_it_starts_with_its_text(database_url: str) -> None:
    """It recorded it as CODE without its text, and a later publication answered 'already recorded with
    this text' while the worker loading published documents never served it."""
    wf = load_document(APPROVAL, catalog)
    async with open_engine(database_url, Registry()) as engine:  # no worker has recorded it
        client = type(engine.client)(engine.store, Registry(wf))
        await client.start(wf, {})
        defs = engine.store.definitions
        [record] = await defs.records(definition_id="approval")
        assert (record.kind, record.status) == ("DOCUMENT", "AVAILABLE")
        assert await defs.document("default", "approval", 1) == (APPROVAL, "yaml")
        assert [(w.id, w.version) for w in await load_published(defs, catalog)] == [("approval", 1)]
        assert (await publish_document(defs, APPROVAL, catalog)).recorded == "unchanged"


async def test_publishing_a_version_registered_from_code_stores_its_text(database_url: str) -> None:
    wf = load_document(APPROVAL, catalog)
    async with open_engine(database_url, Registry()) as engine:
        defs = engine.store.definitions
        await engine.store.register(pin_of(wf), wf.registration_document())  # a Python twin: the same plan
        published = await publish_document(defs, APPROVAL, catalog)
        assert (published.status, published.recorded) == ("AVAILABLE", "attached")
        [record] = await defs.records(definition_id="approval")
        assert record.kind == "DOCUMENT"
        assert [(w.id, w.version) for w in await load_published(defs, catalog)] == [("approval", 1)]
        assert (await publish_document(defs, APPROVAL, catalog)).recorded == "unchanged"
