"""RFC 6902 patches between two JSON documents, for history entries.

Objects are diffed key by key; arrays and scalars that differ are replaced whole,
which keeps patches small for the usual state changes and always correct.
"""

from __future__ import annotations

import copy
from typing import Any


def _pointer(path: list[str]) -> str:
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in path)


def diff(old: Any, new: Any) -> list[dict[str, Any]]:
    """The operations that turn `old` into `new`."""
    ops: list[dict[str, Any]] = []
    _diff(old, new, [], ops)
    return ops


def _diff(old: Any, new: Any, path: list[str], ops: list[dict[str, Any]]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        ops.extend({"op": "remove", "path": _pointer([*path, key])} for key in old if key not in new)
        for key, value in new.items():
            if key not in old:
                ops.append({"op": "add", "path": _pointer([*path, key]), "value": value})
            else:
                _diff(old[key], value, [*path, key], ops)
    elif not same(old, new):
        ops.append({"op": "replace", "path": _pointer(path), "value": new})


def same(a: Any, b: Any) -> bool:
    """Equal as JSON documents. Python's `==` is too loose: it equates false, 0 and 0.0, also inside lists."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


_MISSING = object()


def _at(doc: Any, pointer: str) -> Any:
    """The value at a JSON pointer, or _MISSING."""
    for part in (p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]):
        if isinstance(doc, dict) and part in doc:
            doc = doc[part]
        elif isinstance(doc, list) and part.isdigit() and int(part) < len(doc):
            doc = doc[int(part)]
        else:
            return _MISSING
    return doc


def rebase(base: Any, mine: Any, current: Any) -> Any | None:
    """`mine` (a change made on `base`) carried onto `current` (base changed by someone else), or
    None when both changed the same part. Disjoint changes both land; overlapping ones conflict,
    so no update is ever lost: the caller then redoes its change on `current`."""
    ops = diff(base, mine)
    for op in ops:
        before, now = _at(base, op["path"]), _at(current, op["path"])
        if (before is _MISSING) != (now is _MISSING) or (before is not _MISSING and not same(before, now)):
            return None
        parent = op["path"].rsplit("/", 1)[0]
        if op["path"] and not isinstance(_at(current, parent), dict):
            return None
    return apply_patch(current, ops)


def apply_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """Apply operations produced by `diff` (add, remove, replace) to a copy of `doc`."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        if not parts:
            doc = copy.deepcopy(op["value"])
            continue
        parent = doc
        for p in parts[:-1]:
            parent = parent[p]
        if op["op"] == "remove":
            del parent[parts[-1]]
        else:
            parent[parts[-1]] = copy.deepcopy(op["value"])
    return doc
