"""Contract checks against the version an instance is pinned to (its definition scope's registry row).

The store refuses a signal that the pinned version does not declare; this names that version in the
refusal, so a caller sees which scope and version to look at.
"""

from __future__ import annotations

from stepstone.errors import UnknownSignal
from stepstone.store.registry_port import DefinitionsPort

__all__ = ["explain_unknown_signal"]


async def explain_unknown_signal(definitions: DefinitionsPort, error: UnknownSignal) -> UnknownSignal:
    """The refusal of a signal the pinned version does not declare, naming that version's scope, id,
    version and the signals it declares (read only on this error path, so a signal costs nothing more)."""
    if error.instance_id is None:  # no instance: the error names the workflow already
        return error
    row = await definitions.pinned_contract(error.instance_id)
    if row is None:
        return error
    return UnknownSignal(error.name, error.instance_id, scope=str(row["scope"]),
                         definition_id=str(row["definition_id"]), version=int(row["version"]),
                         declared=tuple(row["signal_names"] or ()))
