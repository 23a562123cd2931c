"""Checking a JSON value against a JSON Schema recorded without the code that wrote it: a task decision's
payload against the task's form, a schedule's stored input against a version's input schema."""

from __future__ import annotations

from typing import Any

__all__ = ["schema_refusal"]


def schema_refusal(schema: Any, value: Any, whole: str = "input") -> str | None:
    """Why the JSON Schema `schema` (2020-12, as pydantic writes it) refuses `value`, in a line naming where
    (`whole` for the value itself); None when it takes it or there is no schema."""
    if not isinstance(schema, dict):
        return None
    import jsonschema  # noqa: PLC0415 - tens of ms of start-up, paid only where a schema is checked

    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(value))
    if error is None:
        return None
    where = ".".join(str(p) for p in error.absolute_path) or whole
    message = error.message if len(error.message) <= 300 else error.message[:297] + "..."
    if error.validator == "required" and isinstance(error.instance, dict):
        message = "missing " + ", ".join(str(f) for f in error.validator_value if f not in error.instance)
    return f"{where}: {message}"
