"""Reading a workflow document's text into data, with the line and column of every value by its path.

The reader refuses, before the schema sees the data, what would make the reading itself costly: YAML
aliases that expand to more values than the size limit has bytes (the "billion laughs", a few hundred
bytes that expand to a billion values), and an alias inside the node it names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stepstone.errors import DocumentInvalid

if TYPE_CHECKING:
    import yaml

# yaml is imported where a document is read (see stepstone.authoring.documents).

__all__ = ["Marks", "located", "parse"]

Marks = dict[tuple[Any, ...], tuple[int, int]]
"""(line, column), 1-based, of each value by its path; a key's own place is under (*path, key, "<key>")."""


def parse(text: str, fmt: str, *, max_values: int) -> tuple[Any, Marks]:
    """The document's data and marks; DocumentInvalid for a syntax error or a document that expands to
    more than `max_values` values through aliases."""
    if fmt == "json":
        _check_json(text)
    import yaml  # noqa: PLC0415 - see the module's imports

    loader = yaml.SafeLoader(text)
    try:  # JSON is YAML: one parser gives the marks of both
        node = loader.get_single_node()
        marks: Marks = {}
        if node is None:
            return None, marks
        _check_expansion(node, max_values)
        _walk(node, (), marks)
        return loader.construct_document(node), marks
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line, column = (mark.line + 1, mark.column + 1) if mark is not None else (None, None)
        raise DocumentInvalid(f"line {line}, column {column}: not valid YAML: {exc.problem}",
                              line=line, column=column) from None
    except yaml.YAMLError as exc:
        raise DocumentInvalid(f"not valid YAML: {type(exc).__name__}") from None
    except RecursionError:
        raise DocumentInvalid("the document is nested too deeply") from None
    finally:
        loader.dispose()


def _check_json(text: str) -> None:
    import json  # noqa: PLC0415 - json is cheap, but only this path needs it

    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise DocumentInvalid(f"line {exc.lineno}, column {exc.colno}: not valid JSON: {exc.msg}",
                              line=exc.lineno, column=exc.colno) from None
    except RecursionError:
        raise DocumentInvalid("the document is nested too deeply") from None


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
                raise _at(node, f"through YAML aliases, this value expands to more values than the size "
                                f"limit allows ({max_values:,})")
        open_nodes.discard(key)
        sizes[key] = total
        return total

    size(root)


def _at(node: yaml.Node, message: str) -> DocumentInvalid:
    line, column = node.start_mark.line + 1, node.start_mark.column + 1
    return DocumentInvalid(f"line {line}, column {column}: {message}", line=line, column=column)


def _walk(node: yaml.Node, path: tuple[Any, ...], marks: Marks) -> None:
    marks[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    import yaml  # noqa: PLC0415 - see the module's imports

    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            name = key.value
            marks[(*path, name, "<key>")] = (key.start_mark.line + 1, key.start_mark.column + 1)
            _walk(value, (*path, name), marks)
    elif isinstance(node, yaml.SequenceNode):
        for n, item in enumerate(node.value):
            _walk(item, (*path, n), marks)


def where(path: tuple[Any, ...]) -> str:
    """A path as the document names it: ``steps[2].handler``."""
    out = ""
    for part in path:
        if part == "<key>":
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(document)"


def located(message: str, path: tuple[Any, ...], marks: Marks) -> DocumentInvalid:
    """A problem at `path`, with the line and column of the nearest value the marks know."""
    probe = path
    while probe not in marks and probe:
        probe = probe[:-1]
    line, column = marks.get(probe, (None, None))
    at = f"line {line}, column {column} " if line is not None else ""
    return DocumentInvalid(f"{at}({where(path)}): {message}", path=where(path), line=line, column=column)
