"""RFC 6902 patches between two JSON documents, for history entries.

Objects are diffed key by key; arrays and scalars that differ are replaced whole,
which keeps patches small for the usual state changes and always correct.
"""

from __future__ import annotations

import copy
from typing import Any

_CONTAINERS = (dict, list)


def _pointer(path: list[Any]) -> str:
    # str(): a handler may leave a key JSON cannot hold (an int in a dict state); the state's encoding then
    # refuses it as for any other value JSON cannot hold, instead of the diff crashing the worker.
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def diff(old: Any, new: Any) -> list[dict[str, Any]]:
    """The operations that turn `old` into `new`."""
    ops: list[dict[str, Any]] = []
    _diff(old, new, [], ops)
    return ops


def _diff(old: Any, new: Any, path: list[str], ops: list[dict[str, Any]]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        if same(old, new):  # most of a state is left as it was: one comparison, mostly in C
            return
        ops.extend({"op": "remove", "path": _pointer([*path, key])} for key in old if key not in new)
        for key, value in new.items():
            if key not in old:
                ops.append({"op": "add", "path": _pointer([*path, key]), "value": value})
                continue
            was = old[key]
            if type(was) is type(value) and not isinstance(value, _CONTAINERS) and was == value:
                continue  # an unchanged scalar, without a call (a map's results hold thousands)
            _diff(was, value, [*path, key], ops)
    elif not same(old, new):
        ops.append({"op": "replace", "path": _pointer(path), "value": new})


def same(a: Any, b: Any) -> bool:
    """Equal as JSON documents. Python's `==` is too loose: it equates false, 0 and 0.0, also inside lists.
    It is not too strict, though (NaN, which it never equates, is never stored), so containers that `==`
    finds different differ; of those it finds equal, the members must also be of the same types, which
    `map` compares in C, and only the members that are containers are compared further. For a map's state
    of 16 KB this takes about 40 µs, where comparing each member in Python took 300."""
    if type(a) is not type(b):
        return False
    if not isinstance(a, _CONTAINERS):
        return bool(a == b)
    if a != b:
        return False
    if isinstance(a, dict):
        ours, theirs = list(a.values()), list(map(b.__getitem__, a))  # == found the same keys
    else:
        ours, theirs = a, b
    kinds = list(map(type, ours))
    if kinds != list(map(type, theirs)):
        return False
    if not any(issubclass(kind, _CONTAINERS) for kind in set(kinds)):
        return True
    return all(same(x, y) for x, y in zip(ours, theirs, strict=True) if isinstance(x, _CONTAINERS))


def changes(base: Any, new: Any, ops: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """What a step changed, as the commit can carry it onto a newer state: each operation of
    `diff(base, new)` (or `ops`, when the caller has it already) with its object path as a list of
    keys, the value it found there (`old`, absent when there was none) and what it made of it
    (`value`, absent for a remove)."""
    out: list[dict[str, Any]] = []
    for op in diff(base, new) if ops is None else ops:
        path = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        change: dict[str, Any] = {"path": path}
        if op["op"] != "add":
            change["old"] = _at(base, path)
        if op["op"] != "remove":
            change["value"] = op["value"]
        out.append(change)
    return out


def _at(doc: Any, path: list[str]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


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
