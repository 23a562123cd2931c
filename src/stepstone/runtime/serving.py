"""What a worker serves: its definitions recorded at start-up, and a heartbeat of its pins.

At start-up a worker records every definition of its registry (CODE, or DOCUMENT for one loaded from a
document) in the registry; a version whose plan hash changed without a version bump is refused there
(DefinitionDrift) and the worker does not start. Its heartbeat then says which pins it serves, so the
stranded-instance report can tell instances whose pinned plan no live worker has; each heartbeat also
makes commands that other workers deferred for lack of these plans claimable at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pydantic import BaseModel

from stepstone.authoring.workflow import Registry, Workflow
from stepstone.core.pin import DEFAULT_SCOPE, Pin, pin_of
from stepstone.store.registry_port import DefinitionsPort

__all__ = ["heartbeat_loop", "record_definitions", "served_pins", "state_model_name"]

log = logging.getLogger("stepstone.worker")


def state_model_name(workflow: Workflow[Any]) -> str | None:
    model = workflow.state_model
    return None if model is None else f"{model.__module__}.{model.__qualname__}"


def _input_schema(workflow: Workflow[Any]) -> Any:
    model = workflow.state_model
    if isinstance(model, type) and issubclass(model, BaseModel):
        try:
            return model.model_json_schema()
        except Exception:  # noqa: BLE001 - a schema pydantic cannot render is metadata we do without
            return None
    return None


def _scope(workflow: Workflow[Any]) -> str:
    return str(getattr(workflow, "scope", DEFAULT_SCOPE))


def served_pins(registry: Registry) -> list[Pin]:
    return [pin_of(wf, _scope(wf)) for wf in registry]


async def record_definitions(definitions: DefinitionsPort, registry: Registry) -> None:
    """Record every definition of `registry`; DefinitionDrift (nothing started) when one drifted."""
    for wf in registry:
        document = getattr(wf, "document_text", None)
        await definitions.record(
            pin_of(wf, _scope(wf)), wf.registration_document(),
            kind="CODE" if document is None else "DOCUMENT",
            state_model=state_model_name(wf), input_schema=_input_schema(wf),
            document=document, document_format=getattr(wf, "document_format", None),
        )


async def announce(definitions: DefinitionsPort, worker_id: str, pins: list[Pin]) -> int:
    """One heartbeat: what this worker serves; returns how many deferred commands it made claimable."""
    await definitions.heartbeat(worker_id, pins)
    return await definitions.resume_deferred(pins) if pins else 0


async def heartbeat_loop(definitions: DefinitionsPort, worker_id: str, pins: list[Pin], every: float) -> None:
    while True:
        await asyncio.sleep(every)
        try:
            resumed = await announce(definitions, worker_id, pins)
        except Exception as exc:  # noqa: BLE001 - the loop must outlive any single failure
            log.warning("heartbeat failed (%s: %s)", type(exc).__name__, exc)
            continue
        if resumed:
            log.info("took back %d command(s) deferred by workers without these plans", resumed)
