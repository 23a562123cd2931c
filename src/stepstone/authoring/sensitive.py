"""Marking state fields sensitive: `Annotated[str, Sensitive]` or `Field(json_schema_extra={"sensitive": True})`.

`sensitive_paths(Model)` lists the key paths of every marked field, nested models and lists of
models included (`*` stands for any list item). The worker redacts those values out of history,
patches and errors (`stepstone.core.redaction`); the database redacts them out of start baselines;
the operations' output shows them as `[redacted]`.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel

__all__ = ["Sensitive", "sensitive_paths"]


class Sensitive:
    """Marker: `Annotated[str, Sensitive]` (the class or an instance) keeps the value out of history."""


def _marked(field: Any) -> bool:
    if any(m is Sensitive or isinstance(m, Sensitive) for m in getattr(field, "metadata", ())):
        return True
    extra = getattr(field, "json_schema_extra", None)
    return isinstance(extra, dict) and extra.get("sensitive") is True


def _models_in(annotation: Any, depth: int = 0) -> list[tuple[tuple[str, ...], type[BaseModel]]]:
    """Models reachable from a field's type, with the path steps in between (`*` for list items)."""
    if depth > 8:
        return []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [((), annotation)]
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _models_in(args[0], depth + 1)
    if origin in (typing.Union, types.UnionType):
        return [found for arg in args for found in _models_in(arg, depth + 1)]
    if origin in (list, tuple, set, frozenset) and args:
        return [(("*", *path), model) for path, model in _models_in(args[0], depth + 1)]
    return []


def sensitive_paths(model: type[BaseModel] | None, _depth: int = 0) -> tuple[tuple[str, ...], ...]:
    """Key paths of every field marked sensitive in `model` (none for a model-less workflow)."""
    if model is None or not (isinstance(model, type) and issubclass(model, BaseModel)) or _depth > 8:
        return ()
    found: list[tuple[str, ...]] = []
    for name, field in model.model_fields.items():
        if _marked(field):
            found.append((name,))
            continue
        for path, inner in _models_in(field.annotation):
            found.extend((name, *path, *sub) for sub in sensitive_paths(inner, _depth + 1))
    return tuple(dict.fromkeys(found))
