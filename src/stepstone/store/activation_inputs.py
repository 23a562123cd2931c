"""What an activation hands its version: the schedules whose ticks start it from then on, and the ones among
them whose stored input that version's input schema (recorded at its registration) refuses.

The registry's `activate` runs it in the activation's transaction, under the definition's lock, so the
answer is the one the activation made (docs/schedules.md). A version recorded without an input schema (no
pydantic state model) refuses none here; its worker still checks every tick.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from stepstone.json_schemas import schema_refusal
from stepstone.store.registry_port import RefusedInput

__all__ = ["Versions", "inputs_refused"]


class Versions(Protocol):
    """The two registry reads the check makes."""

    async def select_version(self, scope: str, definition_id: str) -> tuple[str, int, str] | None: ...
    async def find(self, scope: str, definition_id: str, version: int) -> dict[str, Any]: ...


async def inputs_refused(
    schedules: Iterable[Mapping[str, Any]], versions: Versions, definition_id: str, version: int
) -> list[RefusedInput]:
    """Of `schedules` (rows with name, scope, definition_id, input), those of `definition_id` whose ticks start
    `version` (what a start in the schedule's scope selects) and whose input that version refuses. The
    selection is read once per scope and the schema once per selected row, not once per schedule."""
    chosen: dict[str, tuple[str, int, str] | None] = {}  # a schedule's scope -> what a start there selects
    schemas: dict[str, Any] = {}  # the selected row's scope -> its input schema
    refused = []
    for row in schedules:
        if row["definition_id"] != definition_id:
            continue
        scope = str(row["scope"])
        if scope not in chosen:
            chosen[scope] = await versions.select_version(scope, definition_id)
        selected = chosen[scope]
        if selected is None or selected[1] != version:
            continue
        if selected[0] not in schemas:
            schemas[selected[0]] = (await versions.find(selected[0], definition_id, version)).get("input_schema")
        problem = schema_refusal(schemas[selected[0]], {} if row["input"] is None else row["input"])
        if problem is not None:
            refused.append(RefusedInput(str(row["name"]), scope, problem))
    return refused
