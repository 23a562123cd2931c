"""Definition operations: validate and publish documents, read them back, activate a version, the stranded
report.

The CLI (`stepstone definitions ...`), the HTTP API and programs call these; the rules live in the registry
(`stepstone.store.registry`) and the document loader (`stepstone.authoring.documents`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from stepstone.authoring.documents import DEFAULT_MAX_BYTES, Catalog, DocumentWorkflow, load_document
from stepstone.authoring.registration import state_model_name
from stepstone.core.pin import Pin, pin_of
from stepstone.errors import StepstoneError
from stepstone.store.port import ClientStore
from stepstone.store.registry_port import (
    SERVED_WITHIN_SECONDS,
    DefinitionRecord,
    DefinitionsPort,
    RefusedInput,
    StrandedPin,
)

__all__ = ["Activated", "Published", "activate", "load_published", "publish_document", "publish_loaded",
           "stranded_report"]

log = logging.getLogger("stepstone.definitions")

DEFAULT_STRANDED_WITHIN = SERVED_WITHIN_SECONDS
"""Seconds without a heartbeat after which a pin counts as served by no live worker (5 minutes)."""


@dataclass(frozen=True)
class Published:
    pin: Pin
    status: str
    recorded: str
    """'inserted' for a new version, 'unchanged' when the same text was published before, 'attached' when the
    version was registered from code without its text (the text is stored now)."""


async def publish_document(
    definitions: DefinitionsPort, text: str, catalog: Catalog, *, fmt: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Published:
    """Validate `text` against the schema and `catalog`, record it as a CANDIDATE, publish it (PUBLISHING,
    then AVAILABLE). Nothing is written when the document is invalid; the same version with other
    structure or text is drift (DefinitionDrift)."""
    return await publish_loaded(definitions, load_document(text, catalog, fmt=fmt, max_bytes=max_bytes))


async def publish_loaded(definitions: DefinitionsPort, wf: DocumentWorkflow) -> Published:
    """Record a document `load_document` accepted as a CANDIDATE and publish it (`publish_document`'s
    second half, for a caller that checks something of the loaded document first: the API, its scope)."""
    pin = pin_of(wf, wf.scope)
    recorded = await definitions.record(
        pin, wf.plan.document(), kind="DOCUMENT", status="CANDIDATE", state_model=state_model_name(wf),
        document=wf.document_text, document_format=wf.document_format,
    )
    status = await definitions.publish(pin)
    return Published(pin, status, recorded)


async def load_published(
    definitions: DefinitionsPort, catalog: Catalog, *, scope: str | None = None
) -> list[DocumentWorkflow]:
    """Every AVAILABLE or DEPRECATED document (of `scope`, or all), its text's digest checked and bound to
    `catalog`: what a worker adds to its registry to run published documents. A document that cannot be
    used (its text changed, a handler the catalog lacks) is logged as an error and left out: its
    instances wait, as for any version no worker serves, and every other document still loads."""
    found = []
    for status in ("AVAILABLE", "DEPRECATED"):
        for rec in await definitions.records(scope=scope, status=status):
            if rec.kind != "DOCUMENT":
                continue
            try:
                found.append(await _load_one(definitions, catalog, rec))
            except StepstoneError as exc:
                log.error(  # noqa: TRY400 - one line: the reason, not a traceback, is the story
                    "published document %s v%s (scope %s) not loaded: %s", rec.definition_id, rec.version, rec.scope,
                    exc)
    return found


async def _load_one(definitions: DefinitionsPort, catalog: Catalog, rec: DefinitionRecord) -> DocumentWorkflow:
    text, fmt = await definitions.document(rec.scope, rec.definition_id, rec.version)
    # the size limit is the one it was published under, which is not recorded: its own size admits it
    return load_document(text, catalog, fmt=fmt, max_bytes=max(DEFAULT_MAX_BYTES, len(text.encode())))


async def stranded_report(
    definitions: DefinitionsPort, within_seconds: float = DEFAULT_STRANDED_WITHIN, scope: str | None = None
) -> list[StrandedPin]:
    """Instances that may still run whose pinned plan no worker served in the last `within_seconds`."""
    return await definitions.stranded(within_seconds, scope)


@dataclass(frozen=True)
class Activated:
    """A scope's new current version, and the schedules whose stored input that version refuses (each of
    their ticks will be skipped until the input or the activation changes)."""

    scope: str
    workflow: str
    version: int
    of_scope: str
    """The scope whose row is activated: `scope` itself, or the default scope (`--from-default`)."""
    schedules_refused: list[RefusedInput] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def activate(
    store: ClientStore, scope: str, definition_id: str, version: int, *, target_scope: str | None = None,
    actor: str | None = None, log_refused: bool = True,
) -> Activated:
    """Make `version` (of `target_scope`: `scope` or the default scope) the scope's current version, and name
    the schedules whose ticks start it from now on and whose stored input its input schema refuses: each is
    returned (as the registry's `activate` returns them) and logged as a warning on the
    ``stepstone.definitions`` logger unless `log_refused` is false (the CLI prints its own line). The
    activation is not refused for them (it is usually what new starts need)."""
    target = target_scope or scope
    refused = await store.definitions.activate(scope, definition_id, version, target_scope=target, actor=actor)
    for r in refused if log_refused else ():
        log.warning("schedule %s (scope %s) starts %s v%s now, whose input schema refuses its input (%s): every "
                    "tick will be skipped until its input or the activation changes", r.name, r.scope,
                    definition_id, version, r.problem)
    return Activated(scope, definition_id, version, target, refused)
