"""RFC 6902 diffs of states: applying diff(a, b) to a gives b."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from stepstone.core import patch
from stepstone.core.patch import apply_patch, diff

keys = st.text(alphabet=st.sampled_from("ab/~0 1é"), max_size=4)
scalars = st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False, allow_infinity=False) | st.text(
    max_size=3
)
documents = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=20,
)


def same(a: Any, b: Any) -> bool:
    """Equal and of the same JSON types (1, 1.0 and True are three different documents)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@settings(deadline=None)  # a loaded 2-core machine makes per-example timing meaningless
@given(documents, documents)
def test_diff_then_apply_round_trips(old: Any, new: Any) -> None:
    original = copy.deepcopy(old)
    ops = diff(old, new)
    assert same(apply_patch(old, ops), new)
    assert same(old, original)  # neither diff nor apply mutates its input


@settings(deadline=None)  # a loaded 2-core machine makes per-example timing meaningless
@given(documents)
def test_diff_of_equal_documents_is_empty(doc: Any) -> None:
    assert diff(doc, copy.deepcopy(doc)) == []


@settings(deadline=None)  # a loaded 2-core machine makes per-example timing meaningless
@given(st.dictionaries(keys, documents, max_size=4), st.dictionaries(keys, documents, max_size=4))
def test_object_diffs_only_touch_changed_keys(old: dict[str, Any], new: dict[str, Any]) -> None:
    touched = {op["path"].split("/")[1].replace("~1", "/").replace("~0", "~") for op in diff(old, new)}
    changed = {k for k in old.keys() | new.keys() if k not in old or k not in new or not same(old[k], new[k])}
    assert touched == changed


def test_patch_paths_are_escaped_json_pointers() -> None:
    ops = diff({"a/b": 1, "c~d": {"e": 1}}, {"a/b": 2, "c~d": {"e": 2}})
    assert [op["path"] for op in ops] == ["/a~1b", "/c~0d/e"]


@settings(deadline=None)  # a loaded 2-core machine makes per-example timing meaningless
@given(documents, documents)
def test_same_is_json_sameness(a: Any, b: Any) -> None:
    """patch.same compares containers with `==` and their JSON texts first: neither may stand in for it."""
    assert patch.same(a, b) == same(a, b)
    assert patch.same(a, copy.deepcopy(a))


def _reordered(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: _reordered(doc[k]) for k in reversed(list(doc))}
    if isinstance(doc, list):
        return [_reordered(x) for x in doc]
    return doc


@settings(deadline=None)  # a loaded 2-core machine makes per-example timing meaningless
@given(documents)
def test_keys_in_another_order_are_the_same_document(doc: Any) -> None:
    assert patch.same(doc, _reordered(doc))
    assert diff(doc, _reordered(doc)) == []


def test_changes_that_equality_cannot_see_are_changes() -> None:
    # [0, 1] == [False, 1.0] in Python; as JSON they are different documents, also deep in a large one.
    base = {"items": [float(i) for i in range(2000)], "flags": [0, 1], "big": 2**70, "deep": {"x": [{"n": 1}]}}
    new = copy.deepcopy(base)
    new["flags"] = [False, 1.0]
    new["deep"]["x"][0]["n"] = True
    ops = diff(base, new)
    assert sorted(op["path"] for op in ops) == ["/deep/x", "/flags"]
    assert same(apply_patch(base, ops), new)
    assert not patch.same(base, new) and patch.same(base, copy.deepcopy(base))
