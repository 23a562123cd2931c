"""What the registry records of a workflow version besides its pin and plan, in one place for every door
that records one (a worker at start-up, a client before its first start, a publication).

A version loaded from a document is recorded as a DOCUMENT with its text and format, whoever records it
first: a client that recorded it as CODE left it without its text, which a worker loading the published
documents then never served.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from stepstone.authoring.workflow import Workflow

__all__ = ["recorded_fields", "state_model_name"]


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


def recorded_fields(workflow: Workflow[Any]) -> dict[str, Any]:
    """The keyword arguments of `DefinitionsPort.record` that describe `workflow` (all but its status)."""
    document = getattr(workflow, "document_text", None)
    return {
        "kind": "CODE" if document is None else "DOCUMENT",
        "state_model": state_model_name(workflow),
        "input_schema": _input_schema(workflow),
        "document": document,
        "document_format": getattr(workflow, "document_format", None),
    }
