"""Reading a document's text: what the YAML and JSON readers refuse before the schema sees the data."""

from __future__ import annotations

import pytest

from stepstone.authoring.documents import load_document
from stepstone.errors import DocumentInvalid

LEGAL = "id: x\nversion: 1\nsteps:\n  - {name: a, kind: action, handler: ship, start: true}\n"


def _laughs(levels: int) -> str:
    """The "billion laughs": each level is ten aliases of the one before, 10**levels values from a few
    hundred bytes."""
    lines = ["a0: &a0 [" + ", ".join(["x"] * 10) + "]"]
    lines += [f"a{n}: &a{n} [" + ", ".join([f"*a{n - 1}"] * 10) + "]" for n in range(1, levels)]
    return "\n".join(lines) + "\n" + LEGAL


@pytest.mark.parametrize(("levels", "max_bytes"), [(4, 2_000), (9, 256 * 1024)])
def test_aliases_that_expand_past_the_size_limit_are_refused_before_anything_walks_them(
    levels: int, max_bytes: int
) -> None:
    with pytest.raises(DocumentInvalid, match=f"more values than the size limit allows \\({max_bytes:,}\\)") \
            as raised:
        load_document(_laughs(levels), None, max_bytes=max_bytes)
    assert raised.value.line is not None


def test_aliases_within_the_limit_are_read() -> None:
    text = (
        "id: x\nversion: 1\nsteps:\n"
        "  - {name: a, kind: action, handler: h, start: true, next: b, retry: &r {max_attempts: 5}}\n"
        "  - {name: b, kind: action, handler: h, retry: *r}\n")
    wf = load_document(text, None)
    assert [s.retry.max_attempts for s in wf.plan.steps.values()] == [5, 5]


def test_an_alias_inside_its_own_anchor_is_refused() -> None:
    with pytest.raises(DocumentInvalid, match="line 1, column 4: a YAML alias refers to a node that contains it"):
        load_document("a: &a [1, *a]\n" + LEGAL, None)
