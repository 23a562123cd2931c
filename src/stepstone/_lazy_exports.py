"""A package's public names imported when first used (PEP 562), for packages whose names pull in much
that most importers of the package (or of one of its modules) never touch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, namespace: dict[str, Any],
                 homes: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The package's ``__getattr__`` and ``__dir__``: `homes` maps a name to the module defining it."""

    def attribute(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value  # once: later lookups find it without coming here
        return value

    def names() -> list[str]:
        return sorted(set(namespace) | set(namespace["__all__"]))

    return attribute, names
