"""Reading a document's text: what the YAML and JSON readers refuse before the schema sees the data."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from stepstone.authoring.documents import load_document
from stepstone.authoring.workflow import Workflow
from stepstone.cli import cli
from stepstone.errors import DefinitionError, DocumentInvalid

LEGAL = "id: x\nversion: 1\nsteps:\n  - {name: a, kind: action, handler: ship, start: true}\n"


def _laughs(levels: int) -> str:
    """The "billion laughs": each level is ten aliases of the one before, 10**levels values from a few
    hundred bytes."""
    lines = ["a0: &a0 [" + ", ".join(["x"] * 10) + "]"]
    lines += [f"a{n}: &a{n} [" + ", ".join([f"*a{n - 1}"] * 10) + "]" for n in range(1, levels)]
    return "\n".join(lines) + "\n" + LEGAL


@pytest.mark.parametrize(("levels", "max_bytes"), [(6, 256 * 1024), (9, 256 * 1024), (6, 1 << 30)])
def test_aliases_that_expand_past_the_size_limit_are_refused_before_anything_walks_them(
    levels: int, max_bytes: int
) -> None:
    """However large the size limit: the values allowed are a property of the text, so that what publish
    accepted under --max-bytes, a load under the default accepts too."""
    with pytest.raises(DocumentInvalid, match="expands to more than 262,144 values, the most this document may"):
        load_document(_laughs(levels), None, max_bytes=max_bytes)


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


JSON_DOC = ('{"id": "x", "version": 1, "deadline": %s, "steps": [\n'
            '\t{"name": "a", "kind": "timer", "start": true,\n\t "delay": %s, "next": "$end"}]}')


def test_json_is_read_as_json() -> None:
    wf = load_document(JSON_DOC % ("1e3", "2.5E+1"), None, fmt="json")  # tabs, exponents: JSON, not YAML 1.1
    assert (wf.deadline, wf.plan.steps["a"].delay_seconds) == (1000.0, 25.0)
    with pytest.raises(DocumentInvalid, match="its delay must be at most a thousand years, got inf"):
        load_document(JSON_DOC % ("1", "1e400"), None, fmt="json")
    with pytest.raises(DocumentInvalid, match=r"line 1, column 39 \(deadline\): not valid JSON: NaN"):
        load_document(JSON_DOC % ("NaN", "1"), None, fmt="json")
    with pytest.raises(DocumentInvalid, match=r"line 2, column 24 \(steps\[0\].kind\): 'sleep' is not one of"):
        load_document((JSON_DOC % ("1", "1")).replace('"timer"', '"sleep"'), None, fmt="json")


@pytest.mark.parametrize("written", ["1e3", "1E3", "1.0e3", "1000.0e+0", "+1e3"])
def test_yaml_numbers_with_an_exponent_are_numbers_as_in_yaml_1_2(written: str) -> None:
    wf = load_document(LEGAL + f"deadline: {written}\n", None)
    assert wf.deadline == 1000.0


@pytest.mark.parametrize(("text", "fmt", "line", "column", "path"), [
    (LEGAL + "version: 2\n", "yaml", 5, 1, "version"),
    (LEGAL.replace("handler: ship", "handler: ship, handler: h"), "yaml", 4, 44, "steps[0].handler"),
    ('{"id": "x", "version": 1,\n "steps": [], "version": 2}', "json", 2, 15, "version"),
])
def test_a_key_given_twice_in_one_mapping_is_refused_at_the_second(
    text: str, fmt: str, line: int, column: int, path: str
) -> None:
    with pytest.raises(DocumentInvalid) as raised:
        load_document(text, None, fmt=fmt)
    err = raised.value
    assert (err.line, err.column, err.path) == (line, column, path), str(err)
    assert f"the key {path.rpartition('.')[2]!r} is given twice (first at line " in str(err)


def test_a_yaml_merge_key_may_be_overridden() -> None:
    text = ("id: x\nversion: 1\nsteps:\n  - &a {name: a, kind: action, handler: h, start: true, next: b}\n"
            "  - {<<: *a, name: b, start: false, next: $end}\n")
    assert list(load_document(text, None).plan.steps) == ["a", "b"]


@pytest.mark.parametrize(("text", "words"), [
    ("? [a]\n: 1\n" + LEGAL, "line 1, column 3: a key must be a name, not a list or a mapping"),
    (LEGAL + "1: 2\n", 'line 5, column 1: the key \'1\' is read as int, not as a name: quote it ("1")'),
    (LEGAL.replace("start: true", "start: true, on: b"), "line 4, column 57: the key 'on' is read as bool"),
])
def test_keys_that_are_no_names_are_refused(text: str, words: str) -> None:
    with pytest.raises(DocumentInvalid, match=re.escape(words)):
        load_document(text, None)


@pytest.mark.parametrize(("text", "fmt", "where", "words"), [
    (LEGAL.replace("version: 1", "version: 99999999999"), "yaml", "line 2, column 10 (version)",
     "99999999999 is greater than the maximum of 2147483647"),
    (LEGAL.replace("start: true", 'start: true, description: "a\\ud800b"'), "yaml",
     "line 4, column 70 (steps[0].description)", "a lone surrogate (U+D800), which UTF-8 cannot hold"),
    (LEGAL.replace("start: true", 'start: true, description: "a\\0b"'), "yaml",
     "line 4, column 70 (steps[0].description)", "a NUL character, which PostgreSQL text cannot hold"),
    ('{"id": "x\\u0000", "version": 1, "steps": []}', "json", "line 1, column 8 (id)", "a NUL character"),
    ('{"id": "x", "version": 1, "steps": [], "\\udfff": 1}', "json", "line 1, column 40 ('\\udfff')",
     "a lone surrogate (U+DFFF)"),
])
def test_what_the_database_cannot_hold_is_refused_with_its_place(text: str, fmt: str, where: str, words: str) -> None:
    with pytest.raises(DocumentInvalid) as raised:
        load_document(text, None, fmt=fmt)
    assert str(raised.value).startswith(where + ": ") and words in str(raised.value), str(raised.value)


def test_python_versions_past_the_database_column_are_refused() -> None:
    wf = Workflow("x", version=2**31)
    wf.step(name="a", start=True)(lambda _ctx, _state: None)
    with pytest.raises(DefinitionError, match="version must be a whole number from 1 to 2,147,483,647"):
        wf.plan  # noqa: B018


TWO = ("id: x\nversion: 1\nsteps:\n  - {name: a, kind: action, handler: h, start: true, next: b}\n"
       "  - {name: b, kind: action, handler: h}\n")


@pytest.mark.parametrize(("text", "where", "words"), [
    (TWO.replace("name: b", "name: a").replace("next: b", "next: $end"), "line 5, column 12 (steps[1].name)",
     "step 'a' is defined twice"),
    # The document's spelling of the mark, not Python's `start=True`.
    (TWO.replace("start: true, ", ""), "line 4, column 3 (steps)", "no start step (mark one with start: true)"),
    (TWO.replace("next: b", "next: $end"), "line 4, column 3 (steps)", "unreachable steps: b"),
    (TWO.replace("version: 1", "version: 1.0"), "line 2, column 10 (version)", "a whole number, got 1.0"),
    (TWO + "deadline: .inf\n", "line 6, column 11 (deadline)", "deadline must be at most a thousand years"),
    # Reported at (steps) before, as if the graph were wrong.
    (TWO.replace("next: b}", "next: b, deadline: 1e300}"), "line 4, column 73 (steps[0].deadline)",
     "step 'a': its deadline must be at most a thousand years, got 1e+300 s"),
    (TWO.replace("start: true, next: b}", "start: true, next: w}\n  - {name: w, kind: wait, signals: {go: b}, "
                 "timeout: 1e300, on_timeout: b}"), "line 5, column 54 (steps[1].timeout)",
     "step 'w': its timeout must be at most a thousand years"),
])
def test_problems_found_after_the_schema_have_their_place_too(text: str, where: str, words: str) -> None:
    with pytest.raises(DocumentInvalid) as raised:
        load_document(text, None)
    assert str(raised.value).startswith(where + ": ") and words in str(raised.value), str(raised.value)


def test_a_json_document_without_a_start_step_is_told_the_json_spelling() -> None:
    text = ('{"id": "x", "version": 1, "steps": [{"name": "a", "kind": "action", "handler": "h", "next": "b"},\n'
            ' {"name": "b", "kind": "action", "handler": "h"}]}')
    with pytest.raises(DocumentInvalid) as raised:
        load_document(text, None, fmt="json")
    assert str(raised.value) == 'line 1, column 36 (steps): no start step (mark one with "start": true)'


@pytest.mark.parametrize(("text", "fmt"), [("", "yaml"), ("  \n# nothing yet\n", "yaml"), ("", "json"), ("\n", None)])
def test_an_empty_document_is_called_empty(text: str, fmt: str | None) -> None:
    with pytest.raises(DocumentInvalid, match=r"^the document is empty$"):
        load_document(text, None, fmt=fmt)


def test_a_byte_order_mark_is_taken_by_the_loader_and_the_cli_alike(tmp_path: Path) -> None:
    text = "\ufeff" + JSON_DOC % ("1", "1")
    for fmt in (None, "json"):
        wf = load_document(text, None, fmt=fmt)
        assert (wf.document_format, wf.document_text) == ("json", text)
    (tmp_path / "bom.json").write_text(text, encoding="utf-8")
    done = CliRunner().invoke(cli, ["definitions", "validate", str(tmp_path / "bom.json")])
    assert done.exit_code == 0 and done.stdout.startswith("valid: x v1"), done.output
