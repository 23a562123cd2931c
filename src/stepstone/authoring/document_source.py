"""Reading a workflow document's text into data, with the line and column of every value by its path.

JSON is read as JSON; YAML with PyYAML's safe loader (YAML 1.1) taught one rule of YAML 1.2 and JSON: a
number with an exponent (1e3) is a number.
The reader refuses, before the schema sees the data, what would make the reading itself costly: YAML
aliases that expand the document past the values its caller allows (the "billion laughs", a few
hundred bytes that expand to a billion values), and an alias inside the node it names; and texts the database
cannot store (a NUL, a lone surrogate).
"""

from __future__ import annotations

import bisect
import json
import re
from functools import cache
from json.decoder import scanstring  # type: ignore[attr-defined] # CPython's own, not in typeshed
from json.scanner import NUMBER_RE
from typing import TYPE_CHECKING, Any

from stepstone.errors import DocumentInvalid

if TYPE_CHECKING:
    import yaml

# yaml is imported where a document is read (see stepstone.authoring.documents).

__all__ = ["Marks", "all_of", "located", "parse"]

Marks = dict[tuple[Any, ...], tuple[int, int]]
"""(line, column), 1-based, of each value by its path; a key's own place is under (*path, key, "<key>")."""


def parse(text: str, fmt: str, *, max_values: int) -> tuple[Any, Marks]:
    """The document's data and marks; DocumentInvalid for a syntax error or a document that expands to
    more than `max_values` values through aliases."""
    try:
        data, marks = _parse_json(text) if fmt == "json" else _parse_yaml(text, max_values)
        _check_text(data, (), marks)
    except RecursionError:
        raise DocumentInvalid("the document is nested too deeply") from None
    return data, marks


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_text(value: Any, path: tuple[Any, ...], marks: Marks) -> None:
    """Every text, keys included, can be stored: both formats can spell a NUL ("\\0", "\\u0000"), which
    PostgreSQL's text and jsonb refuse, and a lone surrogate ("\\ud800"), which UTF-8 cannot encode; either
    passed validation and failed publishing (with a traceback for the surrogate)."""
    if isinstance(value, str):
        problem = _unstorable(value)
        if problem:
            raise located(f"the text contains {problem}", path, marks)
    elif isinstance(value, dict):
        for key, item in value.items():
            problem = _unstorable(key) if isinstance(key, str) else None
            if problem:
                raise located(f"the key contains {problem}", (*path, key, "<key>"), marks)
            _check_text(item, (*path, key), marks)
    elif isinstance(value, list):
        for n, item in enumerate(value):
            _check_text(item, (*path, n), marks)


def _unstorable(text: str) -> str | None:
    if "\0" in text:
        return "a NUL character, which PostgreSQL text cannot hold"
    surrogate = _SURROGATE.search(text)
    if surrogate:
        return f"a lone surrogate (U+{ord(surrogate.group()):04X}), which UTF-8 cannot hold"
    return None


# -- YAML ---------------------------------------------------------------------------------------------

# YAML 1.2 (and JSON) read 1e3 as a number; PyYAML reads YAML 1.1, whose floats need a dot and a signed
# exponent, so `deadline: 1e3` was the string '1e3', refused as "not of type 'number'".
_EXPONENT_FLOAT = r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"


@cache
def _loader() -> type[yaml.SafeLoader]:
    import yaml  # noqa: PLC0415 - see the module's imports

    class Loader(yaml.SafeLoader):
        """PyYAML's safe loader, with YAML 1.2's numbers with an exponent."""

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(_EXPONENT_FLOAT), list("-+0123456789"))
    return Loader


def _parse_yaml(text: str, max_values: int) -> tuple[Any, Marks]:
    import yaml  # noqa: PLC0415 - see the module's imports

    loader = None
    try:
        loader = _loader()(text)  # its reader refuses a control character at once: inside the try
        node = loader.get_single_node()
        if node is None:  # nothing but space and comments: None, which the schema would call "not an object"
            raise DocumentInvalid("the document is empty")
        marks: Marks = {}
        _check_expansion(node, max_values)
        _walk(node, (), marks)
        return loader.construct_document(node), marks
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line, column = (mark.line + 1, mark.column + 1) if mark is not None else (None, None)
        raise DocumentInvalid(f"line {line}, column {column}: not valid YAML: {exc.problem}",
                              line=line, column=column) from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not take: where, and which
        raise DocumentInvalid(f"not valid YAML: {exc.reason} #x{exc.character:04x} at character {exc.position}"
                              if isinstance(exc.character, int) else f"not valid YAML: {exc.reason}") from None
    except yaml.YAMLError as exc:
        raise DocumentInvalid(f"not valid YAML: {type(exc).__name__}") from None
    finally:
        if loader is not None:
            loader.dispose()


def _check_expansion(root: yaml.Node, max_values: int) -> None:
    """Count the values the document has once every alias is expanded, each shared node once (so the
    count costs what the text does), and stop at the first node past `max_values`: the walk that marks
    every path, the schema and the plan would each visit all of them."""
    import yaml  # noqa: PLC0415 - see the module's imports

    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise _at(node, "a YAML alias refers to a node that contains it")
        open_nodes.add(key)
        children: list[yaml.Node] = []
        if isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        total = 1
        for child in children:
            total += size(child)
            if total > max_values:
                raise _at(node, f"through YAML aliases, this value expands to more than {max_values:,} "
                                f"values, the most this document may have")
        open_nodes.discard(key)
        sizes[key] = total
        return total

    size(root)


def _mark(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


def _at(node: yaml.Node, message: str) -> DocumentInvalid:
    line, column = _mark(node)
    return DocumentInvalid(f"line {line}, column {column}: {message}", line=line, column=column)


_TEXT, _MERGE = "tag:yaml.org,2002:str", "tag:yaml.org,2002:merge"


def _walk(node: yaml.Node, path: tuple[Any, ...], marks: Marks) -> None:
    """Mark every value and key; refuse a key given twice in one mapping, which PyYAML would let the
    last one win (a merge key's values may be overridden: that is what it is for)."""
    marks[path] = _mark(node)
    import yaml  # noqa: PLC0415 - see the module's imports

    if isinstance(node, yaml.MappingNode):
        seen: dict[tuple[str, str], tuple[int, int]] = {}
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode):
                raise _at(key, "a key must be a name, not a list or a mapping")
            name = key.value
            if key.tag not in (_TEXT, _MERGE):  # YAML 1.1 reads on:, yes: and 1: as true, true and 1
                kind = key.tag.rpartition(":")[2]
                raise _at(key, f"the key {name!r} is read as {kind}, not as a name: quote it (\"{name}\")")
            if key.tag != _MERGE:
                first = seen.setdefault((key.tag, name), _mark(key))
                if first != _mark(key):
                    raise _given_twice((*path, name), first, _mark(key))
            marks[(*path, name, "<key>")] = _mark(key)
            _walk(value, (*path, name), marks)
    elif isinstance(node, yaml.SequenceNode):
        for n, item in enumerate(node.value):
            _walk(item, (*path, n), marks)


# -- JSON ---------------------------------------------------------------------------------------------


def _parse_json(text: str) -> tuple[Any, Marks]:
    """JSON is read as JSON (RFC 8259); the marks come from a second walk of the text, which the
    decoder has accepted, so it only has to find where each value starts."""
    if not text.strip():
        raise DocumentInvalid("the document is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DocumentInvalid(f"line {exc.lineno}, column {exc.colno}: not valid JSON: {exc.msg}",
                              line=exc.lineno, column=exc.colno) from None
    return data, _JsonMarks(text).walk()


_SPACE = re.compile(r"[ \t\n\r]*")


class _JsonMarks:
    def __init__(self, text: str) -> None:
        self.text = text
        self.line_starts = [0, *(m.end() for m in re.finditer("\n", text))]
        self.marks: Marks = {}

    def walk(self) -> Marks:
        self._value(0, ())
        return self.marks

    def _mark(self, pos: int) -> tuple[int, int]:
        line = bisect.bisect_right(self.line_starts, pos)
        return line, pos - self.line_starts[line - 1] + 1

    def _skip(self, pos: int) -> int:
        return _SPACE.match(self.text, pos).end()  # type: ignore[union-attr] # matches the empty string

    def _value(self, pos: int, path: tuple[Any, ...]) -> int:
        """Mark the value at `pos` (after any space); the position after it."""
        pos = self._skip(pos)
        self.marks[path] = self._mark(pos)
        char = self.text[pos]
        if char == "{":
            return self._object(pos + 1, path)
        if char == "[":
            return self._array(pos + 1, path)
        if char == '"':
            return int(scanstring(self.text, pos + 1)[1])
        number = NUMBER_RE.match(self.text, pos)
        if number is not None:
            return number.end()
        for word in ("true", "false", "null"):
            if self.text.startswith(word, pos):
                return pos + len(word)
        # Python's decoder also takes NaN, Infinity and -Infinity; JSON has no such numbers
        line, column = self.marks[path]
        raise DocumentInvalid(f"line {line}, column {column} ({where(path)}): not valid JSON: NaN and Infinity "
                              f"are not JSON numbers", path=where(path), line=line, column=column)

    def _object(self, pos: int, path: tuple[Any, ...]) -> int:
        pos = self._skip(pos)
        if self.text[pos] == "}":
            return pos + 1
        seen: dict[str, tuple[int, int]] = {}
        while True:
            key, after = scanstring(self.text, pos + 1)
            first = seen.setdefault(key, self._mark(pos))
            if first != self._mark(pos):  # Python's decoder keeps the last one
                raise _given_twice((*path, key), first, self._mark(pos))
            self.marks[(*path, key, "<key>")] = self._mark(pos)
            pos = self._skip(self._value(self._skip(after) + 1, (*path, key)))  # past the ':'
            if self.text[pos] == "}":
                return pos + 1
            pos = self._skip(pos + 1)  # past the ','

    def _array(self, pos: int, path: tuple[Any, ...]) -> int:
        pos = self._skip(pos)
        if self.text[pos] == "]":
            return pos + 1
        n = 0
        while True:
            pos = self._skip(self._value(pos, (*path, n)))
            if self.text[pos] == "]":
                return pos + 1
            pos, n = pos + 1, n + 1


# -- paths and places ---------------------------------------------------------------------------------


def where(path: tuple[Any, ...]) -> str:
    """A path as the document names it: ``steps[2].handler``."""
    out = ""
    for part in path:
        if part == "<key>":
            continue
        name = part if not isinstance(part, str) or part.isprintable() else ascii(part)  # a message is one line
        out += f"[{part}]" if isinstance(part, int) else (f".{name}" if out else str(name))
    return out or "(document)"


def _given_twice(path: tuple[Any, ...], first: tuple[int, int], second: tuple[int, int]) -> DocumentInvalid:
    line, column = second
    return DocumentInvalid(f"line {line}, column {column} ({where(path)}): the key {path[-1]!r} is given twice "
                           f"(first at line {first[0]}, column {first[1]})", path=where(path), line=line,
                           column=column)


def located(message: str, path: tuple[Any, ...], marks: Marks) -> DocumentInvalid:
    """A problem at `path`, with the line and column of the nearest value the marks know."""
    probe = path
    while probe not in marks and probe:
        probe = probe[:-1]
    line, column = marks.get(probe, (None, None))
    at = f"line {line}, column {column} " if line is not None else ""
    return DocumentInvalid(f"{at}({where(path)}): {message}", path=where(path), line=line, column=column,
                           problems=({"path": where(path), "line": line, "column": column, "message": message},))


_LISTED = 20
"""At most this many problems are written into the message; `DocumentInvalid.problems` has them all."""


def all_of(problems: list[DocumentInvalid]) -> DocumentInvalid:
    """One error for every problem of a stage, in document order, as a validator reports them: the first
    one's place, every one's text in the message, each in `problems`."""
    problems = sorted(problems, key=lambda p: (p.line or 0, p.column or 0))
    first = problems[0]
    if len(problems) == 1:
        return first
    listed = "; ".join(str(p) for p in problems[:_LISTED])
    more = f"; and {len(problems) - _LISTED} more" if len(problems) > _LISTED else ""
    return DocumentInvalid(f"{len(problems)} problems: {listed}{more}", path=first.path, line=first.line,
                           column=first.column, problems=tuple(q for p in problems for q in p.problems))
