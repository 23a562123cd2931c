"""The definition graph as server-rendered SVG, with the executed path and the current positions.

Pure: it takes the stored plan document (`Plan.document()`), the instance's positions and its
history, and returns SVG text. Steps are laid out left to right in layers (the longest forward path
from the start; edges back to an earlier layer are drawn as arcs below). A node is marked

    current   a live position is at it (running or waiting)
    failed    a failed position is at it
    visited   some position executed it
and an edge is on the executed path when a position went from one of its ends to the other (a
fork to its branches' first steps and branches into their join count when both ends ran).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from html import escape
from typing import Any

from stepstone.ids import short_id

__all__ = ["END_NODE", "Diagram", "diagram", "render_svg"]

END_NODE = "$end"
NODE_W, NODE_H, GAP_X, GAP_Y, PAD = 150, 46, 56, 28, 16
_LIVE = {"RUNNING", "WAITING", "PENDING"}
_ARROW = ('<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="9" markerHeight="9" '
          'markerUnits="userSpaceOnUse" orient="auto-start-reverse">'
          '<path d="M0,0 L10,5 L0,10 z" fill="context-stroke"/></marker></defs>')
_KIND_LABEL = {"action": "", "timer": "timer", "wait": "wait", "fork": "fork", "join": "join", "child": "child"}


@dataclass
class Edge:
    source: str
    target: str
    label: str = ""
    executed: bool = False


@dataclass
class Diagram:
    """Nodes by name (with kind and marks), edges, and each node's (layer, row)."""

    kinds: dict[str, str] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)
    place: dict[str, tuple[int, int]] = field(default_factory=dict)
    visited: set[str] = field(default_factory=set)
    current: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    children: dict[str, list[str]] = field(default_factory=dict)
    """Child step -> ids of the child instances it started."""


def _edges_of(step: Mapping[str, Any]) -> list[tuple[str, str]]:
    kind = step["kind"]
    if kind == "wait":
        out = [(target, signal) for signal, target in sorted(step.get("signals", {}).items())]
        if step.get("on_timeout"):
            out.append((step["on_timeout"], "timeout"))
        return out
    if kind == "fork":
        if step.get("branches"):
            return [(first, name) for name, first in sorted(step["branches"].items())]
        return [(step["branch_step"], f"each of {step.get('map_over')}")] if step.get("branch_step") else []
    nexts = [(n, "") for n in step.get("next", [])] or ([(END_NODE, "")] if kind == "action" else [])
    if kind == "child" and step.get("on_failure"):
        nexts.append((step["on_failure"], "failed"))
    return nexts


def _layers(start: str, adjacency: Mapping[str, list[str]]) -> dict[str, int]:
    """Longest forward path from `start` (edges closing a cycle are ignored), unreachable nodes last."""
    order: list[str] = []
    state: dict[str, int] = {}
    back: set[tuple[str, str]] = set()
    stack: list[tuple[str, Iterable[str]]] = [(start, iter(adjacency.get(start, [])))]
    state[start] = 1
    while stack:
        node, rest = stack[-1]
        nxt = next(iter(rest), None)
        if nxt is None:
            stack.pop()
            state[node] = 2
            order.append(node)
            continue
        if state.get(nxt) == 1:
            back.add((node, nxt))
        elif nxt not in state:
            state[nxt] = 1
            stack.append((nxt, iter(adjacency.get(nxt, []))))
    layer = dict.fromkeys(order, 0)
    for node in reversed(order):
        for nxt in adjacency.get(node, []):
            if (node, nxt) not in back and nxt in layer:
                layer[nxt] = max(layer[nxt], layer[node] + 1)
    deepest = max(layer.values(), default=0)
    for node in adjacency:
        layer.setdefault(node, deepest + 1)
    return layer


def diagram(plan: Mapping[str, Any], positions: Sequence[Mapping[str, Any]],
            history: Sequence[Mapping[str, Any]], *, status: str = "",
            children: Sequence[Mapping[str, Any]] = ()) -> Diagram:
    steps = {s["name"]: s for s in plan.get("steps", [])}
    out = Diagram(kinds={name: s["kind"] for name, s in steps.items()})
    for name, s in steps.items():
        out.edges += [Edge(name, target, label) for target, label in _edges_of(s)]
    if any(e.target == END_NODE for e in out.edges):
        out.kinds[END_NODE] = "end"
    adjacency: dict[str, list[str]] = {n: [] for n in out.kinds}
    for e in out.edges:
        adjacency.setdefault(e.source, []).append(e.target)
    layer = _layers(plan.get("start", next(iter(steps), "")), adjacency)
    rows: dict[int, int] = {}
    for node in sorted(out.kinds, key=lambda n: (layer.get(n, 0), list(out.kinds).index(n))):
        col = layer.get(node, 0)
        out.place[node] = (col, rows.get(col, 0))
        rows[col] = rows.get(col, 0) + 1

    _mark(out, steps, positions, history, status)
    for c in children:
        step = _child_step(c, steps, history)
        if step:
            out.children.setdefault(step, []).append(str(c["id"]))
    return out


def _mark(out: Diagram, steps: Mapping[str, Any], positions: Sequence[Mapping[str, Any]],
          history: Sequence[Mapping[str, Any]], status: str) -> None:
    """Visited steps and walked edges from the history; current and failed steps from the positions."""
    walked: set[tuple[str, str]] = set()
    last: dict[str, str] = {}
    for h in history:
        step, where = h.get("step"), h.get("position") or ""
        if not step or step not in steps:
            continue
        out.visited.add(step)
        before = last.get(where)
        if before is not None and before != step:
            walked.add((before, step))
        last[where] = step
    if status == "COMPLETED":
        out.visited.add(END_NODE)
        root_last = last.get("")
        if root_last is not None:
            walked.add((root_last, END_NODE))
    for p in positions:
        step = p.get("step")
        if step in out.kinds:
            if p.get("status") == "FAILED":
                out.failed.add(step)
            elif p.get("status") in _LIVE:
                out.current.add(step)
    for e in out.edges:
        both = e.source in out.visited and e.target in out.visited
        fan = out.kinds.get(e.source) == "fork" or out.kinds.get(e.target) == "join"
        e.executed = (e.source, e.target) in walked or (both and fan)


def _child_step(child: Mapping[str, Any], steps: Mapping[str, Any], history: Sequence[Mapping[str, Any]]) -> str:
    for h in history:
        data = h.get("data") or {}
        if h.get("kind") == "CHILD_STARTED" and isinstance(data, dict) and str(data.get("child")) == str(child["id"]):
            return str(h.get("step") or "")
    named = [n for n, s in steps.items() if s["kind"] == "child" and s.get("workflow") == child.get("definition_id")]
    return named[0] if len(named) == 1 else ""


def _xy(d: Diagram, node: str) -> tuple[int, int]:
    col, row = d.place[node]
    return PAD + col * (NODE_W + GAP_X), PAD + row * (NODE_H + GAP_Y)


def render_svg(d: Diagram, *, title: str = "workflow", link: str = "") -> str:
    """SVG text; `link` is a URL prefix for child instances (``{link}{id}``), none when empty."""
    if not d.place:
        return '<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="empty plan"></svg>'
    cols = max(c for c, _ in d.place.values()) + 1
    rows = max(r for _, r in d.place.values()) + 1
    width, height = 2 * PAD + cols * NODE_W + (cols - 1) * GAP_X, 2 * PAD + rows * NODE_H + (rows - 1) * GAP_Y + 40
    parts = [(f'<svg xmlns="http://www.w3.org/2000/svg" class="diagram" viewBox="0 0 {width} {height}" '
             f'width="{width}" role="img" aria-labelledby="diagram-title">'),
             f'<title id="diagram-title">{escape(title)}</title>',
             _ARROW]
    for e in d.edges:
        if e.source not in d.place or e.target not in d.place:
            continue
        (x1, y1), (x2, y2) = _xy(d, e.source), _xy(d, e.target)
        cls = "edge executed" if e.executed else "edge"
        if x2 > x1:
            sx, sy, tx, ty = x1 + NODE_W, y1 + NODE_H // 2, x2, y2 + NODE_H // 2
            mid = (sx + tx) // 2
            path = f"M{sx},{sy} C{mid},{sy} {mid},{ty} {tx},{ty}"
            lx, ly = (sx + 6, sy - 6) if ty <= sy else (sx + 6, sy + 14)
        else:  # back to an earlier (or the same) layer: an arc under the row
            sx, sy, tx, ty = x1 + NODE_W // 2, y1 + NODE_H, x2 + NODE_W // 2, y2 + NODE_H
            low = max(sy, ty) + 34
            path = f"M{sx},{sy} C{sx},{low} {tx},{low} {tx},{ty}"
            lx, ly = (sx + tx) // 2, low - 4
        parts.append(f'<path class="{cls}" d="{path}" marker-end="url(#arrow)" '
                     f'data-edge="{escape(e.source)}->{escape(e.target)}"/>')
        if e.label:
            parts.append(f'<text class="edge-label" x="{lx}" y="{ly}">{escape(e.label)}</text>')
    for node, kind in d.kinds.items():
        x, y = _xy(d, node)
        marks = [m for m, s in (("current", d.current), ("failed", d.failed), ("visited", d.visited)) if node in s]
        cls = " ".join(["node", f"kind-{kind}", *marks])
        label = "end" if node == END_NODE else node
        state = ", ".join(marks) or "not run"
        parts.append(f'<g class="{cls}" data-step="{escape(node)}"><title>{escape(label)} ({escape(kind)}): '
                     f'{state}</title>')
        centre = x + (NODE_H // 2 if node == END_NODE else NODE_W // 2)
        shape = (f'<circle cx="{centre}" cy="{y + NODE_H // 2}" r="{NODE_H // 2}"/>' if node == END_NODE
                 else f'<rect x="{x}" y="{y}" width="{NODE_W}" height="{NODE_H}" rx="8"/>')
        parts.append(shape)
        text = label if len(label) <= 20 else label[:19] + "…"
        parts.append(f'<text x="{centre}" y="{y + (28 if node == END_NODE else 20)}" text-anchor="middle" '
                     f'class="node-name">{escape(text)}</text>')
        sub = " · ".join(s for s in (_KIND_LABEL.get(kind, ""), *[m for m in marks if m != "visited"][:1]) if s)
        if sub and node != END_NODE:
            parts.append(f'<text x="{centre}" y="{y + 36}" text-anchor="middle" class="node-kind">'
                         f'{escape(sub)}</text>')
        parts.append("</g>")
        for n, child in enumerate(d.children.get(node, [])[:3]):
            cy = y + NODE_H + 14 + 14 * n
            inner = f'<text x="{x + 4}" y="{cy}" class="child-link">child {escape(short_id(child))}</text>'
            parts.append(f'<a href="{escape(link + child)}">{inner}</a>' if link else inner)
    parts.append("</svg>")
    return "\n".join(parts)
