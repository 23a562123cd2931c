"""Which registered version of a workflow a new instance runs: the one place `Client.start` (a workflow named
by id) and a child step (the child it starts) choose it.

The database chooses (`select_version` of the registry: the scope's activation, else the default scope's,
else the highest AVAILABLE version of the scope, else of the default scope); the caller's registry must
hold that version with the same structure. Nothing is cached: every start asks, so an activation or a
deprecation is seen by the next start (docs/versions.md).
"""

from __future__ import annotations

from typing import Any, Protocol

from stepstone.authoring.workflow import Registry, Workflow
from stepstone.errors import DefinitionNotFound

__all__ = ["SelectsVersions", "selected_workflow"]


class SelectsVersions(Protocol):
    """The registry port's selection (`DefinitionsPort.select_version`)."""

    async def select_version(self, scope: str, definition_id: str) -> tuple[str, int, str] | None: ...


async def selected_workflow(
    definitions: SelectsVersions, registry: Registry, workflow_id: str, scope: str, *, holder: str
) -> Workflow[Any] | None:
    """The version of `workflow_id` a start in `scope` runs, as `registry` holds it; None when the database
    selects none (no activation and no AVAILABLE version in the scope or the default scope).
    DefinitionNotFound when `registry` (`holder` names it in the message) lacks the selected version or
    holds another structure under it."""
    chosen = await definitions.select_version(scope, workflow_id)
    if chosen is None:
        return None
    _, version, plan_hash = chosen
    found = registry.find(workflow_id, version, plan_hash)
    if found is None:
        raise DefinitionNotFound(workflow_id, version, reason=f"is the version scope {scope} selects, and {holder} "
                                 "lacks it (or holds another structure under that version)")
    return found
