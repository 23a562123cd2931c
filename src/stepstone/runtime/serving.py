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

from stepstone.authoring.registration import recorded_fields
from stepstone.authoring.workflow import Registry, Workflow
from stepstone.core.pin import DEFAULT_SCOPE, Pin, pin_of
from stepstone.errors import DatabaseUnavailable
from stepstone.store.registry_port import DefinitionsPort

__all__ = ["heartbeat_loop", "record_definitions", "served_pins"]

log = logging.getLogger("stepstone.worker")



def _scope(workflow: Workflow[Any]) -> str:
    return str(getattr(workflow, "scope", DEFAULT_SCOPE))


def served_pins(registry: Registry) -> list[Pin]:
    return [pin_of(wf, _scope(wf)) for wf in registry]


async def record_definitions(definitions: DefinitionsPort, registry: Registry) -> None:
    """Record every definition of `registry`; DefinitionDrift (nothing started) when one drifted."""
    for wf in registry:
        await definitions.record(pin_of(wf, _scope(wf)), wf.registration_document(), **recorded_fields(wf))


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
            level = logging.DEBUG if isinstance(exc, DatabaseUnavailable) else logging.WARNING  # the claim loop
            log.log(level, "heartbeat failed (%s: %s)", type(exc).__name__, exc)  # tells an outage
            continue
        if resumed:
            log.info("took back %d command(s) deferred by workers without these plans", resumed)
