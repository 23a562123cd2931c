"""Workflows described as YAML or JSON documents, bound to Python handlers registered in a catalog.

    catalog = Catalog()

    @catalog.handler("review")
    async def review(ctx, state): ...

    wf = load_document(Path("approval.yaml").read_text(), catalog)   # a Workflow, like a Python one

A document is checked in this order, and the problems of the first stage that finds any are raised as
one `DocumentInvalid` (every one in its `problems`, the first's place on the error), each naming the
document path (``steps[2].next``) with its line and column: the size limit (default 256 KiB of UTF-8),
the YAML/JSON syntax (`stepstone.authoring.document_source`: YAML aliases may not expand the document
past 262,144 values, or one per byte of a larger text), the published JSON Schema (`SCHEMA`, shipped as
``workflow-document.schema.json`` beside this module and in docs/), the steps every transition
names, handler and model names against the catalog, then the graph rules every plan obeys (a
problem of one step at that step, or at its field). The last four stages report every problem they
find, not only the first. Each step
goes through the same `Workflow` call a Python author makes, so a document and its Python twin have
one plan and one plan hash. The plan hash covers structure only, so
the same document bound to other handler bodies keeps its version.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from functools import cache
from importlib import resources
from typing import Any, TypeVar

from stepstone.authoring.document_source import Marks, all_of, located, parse
from stepstone.authoring.workflow import Retry, Workflow
from stepstone.core.plan import END, Step, long_durations, plan_problems
from stepstone.errors import DefinitionError, DocumentInvalid

# yaml and jsonschema (with referencing and attrs) are imported where a document is read: together they
# were 60 ms of every `stepstone` command's start-up, and most commands never read a document.

__all__ = ["DEFAULT_MAX_BYTES", "Catalog", "DocumentWorkflow", "load_document", "schema"]

DEFAULT_MAX_BYTES = 256 * 1024
_MAX_EXPANSION = DEFAULT_MAX_BYTES
"""The values a document may have once its YAML aliases are expanded (or one per byte of a larger one):
a property of the text alone, so what publish accepted, every later load accepts too."""
F = TypeVar("F", bound=Callable[..., Any])


class Catalog:
    """The handlers (and state models) documents may name, by registered name."""

    def __init__(self) -> None:
        self.handlers: dict[str, Callable[..., Any]] = {}
        self.models: dict[str, type[Any]] = {}

    def handler(self, name: str) -> Callable[[F], F]:
        """Register a handler under `name` (a decorator)."""

        def register(fn: F) -> F:
            self.add(name, fn)
            return fn

        return register

    def add(self, name: str, fn: Callable[..., Any]) -> None:
        if name in self.handlers and self.handlers[name] is not fn:
            raise DefinitionError(f"catalog: handler {name!r} is registered twice")
        self.handlers[name] = fn

    def model(self, name: str, model: type[Any]) -> None:
        """Register a state model (a pydantic model class) under `name`."""
        self.models[name] = model


class DocumentWorkflow(Workflow[Any]):
    """A workflow loaded from a document: it keeps the text it came from, its format and its scope."""

    def __init__(self, id: str, *, version: int, state: type[Any] | None, scope: str,  # noqa: A002
                 document_text: str, document_format: str, deadline: float | None = None) -> None:
        super().__init__(id, version=version, state=state, deadline=deadline)
        self.scope = scope
        self.document_text = document_text
        self.document_format = document_format

    def declared_steps(self) -> list[Step]:
        """The steps as declared, before the plan validates them (to show a problem at its field)."""
        return list(self._steps)

    def plan_problems(self, stand_ins: Sequence[Step] = (), start: str | None = None) -> list[str]:
        """Every problem the plan's validation would find in the steps declared so far, one text each;
        with `stand_ins` (and the `start` one of them is) for steps that could not be declared."""
        steps = [*self._steps, *stand_ins]
        start = self._start or start or (steps[0].name if len(steps) == 1 else None)  # as `plan` takes it
        mark = '"start": true' if self.document_format == "json" else "start: true"  # as the document spells it
        return plan_problems(self.id, self.version, start, steps, start_mark=mark)


@cache
def schema() -> dict[str, Any]:
    """The published JSON Schema of workflow documents."""
    text = resources.files("stepstone.authoring").joinpath("workflow-document.schema.json").read_text("utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def load_document(
    text: str, catalog: Catalog | None, *, fmt: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
) -> DocumentWorkflow:
    """Validate a document and build its workflow. `catalog` None checks structure only (handlers are
    not bound: the result can be hashed and inspected, not run). `fmt` is "yaml" or "json" (default:
    guessed from the first character)."""
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > max_bytes:
        raise DocumentInvalid(f"the document is {size} bytes, over the limit of {max_bytes} bytes")
    # A byte order mark is read past (YAML skipped it, json refused it): an editor may add one. The text
    # is kept as it came, so the one stored before with a mark is still the same text.
    body = text.removeprefix("\ufeff")
    fmt = fmt or ("json" if body.lstrip().startswith("{") else "yaml")
    if fmt not in ("yaml", "json"):
        raise DocumentInvalid(f"unknown document format {fmt!r} (yaml or json)")
    data, marks = parse(body, fmt, max_values=max(_MAX_EXPANSION, size))
    _check_schema(data, marks)
    _check_targets(data, marks)
    if catalog is not None:
        _check_catalog(data, marks, catalog)
    return _build(data, marks, catalog, text, fmt)


# -- checking the data --------------------------------------------------------------------------


def _check_schema(data: Any, marks: Marks) -> None:
    import jsonschema  # noqa: PLC0415 - see the module's imports

    validator = jsonschema.Draft202012Validator(schema())
    problems = [_schema_problem(found, marks) for found in validator.iter_errors(data)]
    if problems:
        raise all_of(problems)


def _schema_problem(found: Any, marks: Marks) -> DocumentInvalid:
    """One problem the schema found, at its place (of the alternatives a oneOf tried, the best match)."""
    import jsonschema  # noqa: PLC0415 - see the module's imports

    error = jsonschema.exceptions.best_match([found])
    path = tuple(error.absolute_path)
    message = error.message
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = error.schema.get("properties", {})
        extra = sorted((k for k in error.instance if k not in allowed), key=str)
        if extra:
            path = (*path, extra[0], "<key>")
            message = f"unknown field {extra[0]!r}" if len(extra) == 1 else (
                f"unknown fields {', '.join(map(repr, extra))}")
    if len(message) > 300:
        message = message[:297] + "..."
    return located(message, path, marks)


_TARGET_FIELDS = ("next", "on_timeout", "on_deadline", "on_failure", "on_expire", "branch")
_ROUTE_FIELDS = ("signals", "messages", "decisions", "errors", "branches")


def _check_targets(data: dict[str, Any], marks: Marks) -> None:
    """Step names are unique and every step a step may go to exists (or is $end): every problem is named
    with its place, before the graph rules (which know no lines) see the steps."""
    names: set[str] = set()
    problems: list[DocumentInvalid] = []
    for n, step in enumerate(data["steps"]):
        if step["name"] in names:
            problems.append(located(f"step {step['name']!r} is defined twice", ("steps", n, "name"), marks))
        names.add(step["name"])
    for n, step in enumerate(data["steps"]):
        for path, target in _targets(step, n):
            if target != END and target not in names:
                known = ", ".join(sorted(names))
                problems.append(located(f"step {step['name']!r} goes to unknown step {target!r} (the steps are: "
                                        f"{known})", path, marks))
    if problems:
        raise all_of(problems)


def _targets(step: dict[str, Any], n: int) -> list[tuple[tuple[Any, ...], Any]]:
    """Every step the `n`th step may go to, each with its place."""
    places: list[tuple[tuple[Any, ...], Any]] = []
    for key in _TARGET_FIELDS:
        value = step.get(key)
        if isinstance(value, list):
            places += [(("steps", n, key, i), t) for i, t in enumerate(value)]
        elif value is not None:
            places.append((("steps", n, key), value))
    for key in _ROUTE_FIELDS:
        places += [(("steps", n, key, route), t) for route, t in (step.get(key) or {}).items()]
    return places


def _check_catalog(data: dict[str, Any], marks: Marks, catalog: Catalog) -> None:
    """Every handler and model the document names is in the catalog: each one that is not is named with
    its place (what the catalog has, once per kind)."""
    handlers = ", ".join(sorted(catalog.handlers)) or "none"
    models = ", ".join(sorted(catalog.models)) or "none"
    problems: list[DocumentInvalid] = []
    if "state" in data and data["state"] not in catalog.models:
        problems.append(located(f"unknown state model {data['state']!r} (the catalog has: {models})", ("state",),
                                marks))
    for n, step in enumerate(data["steps"]):
        named: list[tuple[tuple[Any, ...], Any]] = [(("steps", n, "handler"), step["handler"])] \
            if "handler" in step else []
        if "compensation" in step:
            named.append((("steps", n, "compensation", "handler"), step["compensation"]["handler"]))
        problems += [located(f"unknown handler {name!r} (the catalog has: {handlers})", path, marks)
                     for path, name in named if name not in catalog.handlers]
        problems += [located(f"unknown payload model {name!r} (the catalog has: {models})",
                             ("steps", n, "payloads", route), marks)
                     for route, name in (step.get("payloads") or {}).items() if name not in catalog.models]
    if problems:
        raise all_of(problems)


# -- building the workflow ----------------------------------------------------------------------


def _unbound(*_: Any) -> None:
    raise DefinitionError("this workflow was loaded without a catalog: its handlers are not bound")


def _handler(step: dict[str, Any], catalog: Catalog | None) -> Any:
    """The catalog's handler of the step (`_check_catalog` has made sure it has it)."""
    return _unbound if catalog is None else catalog.handlers[step["handler"]]


def _build(
    data: dict[str, Any], marks: Marks, catalog: Catalog | None, text: str, fmt: str
) -> DocumentWorkflow:
    """The workflow, every step through its authoring call; every problem of the graph stage raised at
    once: the document's own fields, each step's, then the plan's rules (a rule about one step at it)."""
    problems: list[DocumentInvalid] = []
    model = None if catalog is None else catalog.models.get(data.get("state", ""))
    version = data["version"]
    if not isinstance(version, int):  # the schema's integer takes 1.0, which no version column holds
        problems.append(located(f"version must be a whole number, got {version!r}", ("version",), marks))
        version = 1  # stands in, so the steps are still checked
    try:  # the document's own fields: the schema has checked all but the deadline's thousand years
        wf = DocumentWorkflow(data["id"], version=version, state=model, scope=data.get("scope", "default"),
                              document_text=text, document_format=fmt, deadline=data.get("deadline"))
    except DefinitionError as exc:
        problems.append(located(str(exc), ("deadline",), marks))
        wf = DocumentWorkflow(data["id"], version=version, state=model, scope=data.get("scope", "default"),
                              document_text=text, document_format=fmt)
    failed: list[str] = []  # steps not added: the plan's rules would call them unknown
    for n, step in enumerate(data["steps"]):
        try:
            if stray := _stray_payloads(step, n, marks):
                problems += stray
            else:
                _add_step(wf, step, n, catalog, marks)
                continue
        except DocumentInvalid as exc:
            problems.append(exc)
        failed.append(step["name"])
    problems += _plan_problems(wf, data["steps"], failed, marks)
    if problems:
        raise all_of(problems)
    wf.plan  # noqa: B018 - freeze it now (its rules found nothing above)
    return wf


def _plan_problems(
    wf: DocumentWorkflow, steps: list[dict[str, Any]], failed: list[str], marks: Marks,
) -> list[DocumentInvalid]:
    """The plan's rules, each problem at the step it is about (a duration's at its field), else at
    ``steps``; a problem that names a step that could not be added is left out (it is reported already).
    Such a step stands in for itself, with only its name and where it goes, so that its absence makes no
    problem of the graph ("no start step" for the start step, the steps after it "unreachable")."""
    index = {step["name"]: n for n, step in enumerate(steps)}
    fields = {problem: ("steps", index[s.name], field)
              for s in wf.declared_steps() for field, problem in long_durations(s)}
    missing = [(n, step) for n, step in enumerate(steps) if step["name"] in failed]
    stand_ins = [_stand_in(step, n) for n, step in missing]
    start = next((step["name"] for _, step in missing if step.get("start")), None)
    found = []
    for problem in wf.plan_problems(stand_ins, start):
        if any(f"{name!r}" in problem for name in failed):
            continue
        named = [(problem.find(f"{name!r}"), name) for name in index if f"{name!r}" in problem]
        path = fields.get(problem) or (("steps", index[min(named)[1]]) if named else ("steps",))
        found.append(located(problem, path, marks))
    return found


def _stand_in(step: dict[str, Any], n: int) -> Step:
    """A step that could not be added, as the graph's rules see it: a fork with its branches, any other
    kind an action going where the step may go (its own problems name it, and are left out)."""
    if step["kind"] == "fork":
        return Step(step["name"], "fork", branches=step.get("branches") or {}, map_over=step.get("map_over"),
                    branch_step=step.get("branch"))
    return Step(step["name"], "action", next=tuple(target for _, target in _targets(step, n)))


def _stray_payloads(step: dict[str, Any], n: int, marks: Marks) -> list[DocumentInvalid]:
    """A payload model for a route the step does not have: a wait's signals and messages, a task's
    decisions."""
    if step["kind"] == "task":
        routes, what = step["decisions"], "not one of the task's decisions"
    else:
        routes, what = {**(step.get("signals") or {}), **(step.get("messages") or {})}, \
            "none of the wait's signals and messages"
    return [located(f"payload for {route!r}, which is {what}", ("steps", n, "payloads", route), marks)
            for route in step.get("payloads") or {} if route not in routes]


def _add_step(
    wf: DocumentWorkflow, step: dict[str, Any], n: int, catalog: Catalog | None,
    marks: Marks,
) -> None:
    """One step, through the same authoring call a Python workflow makes (so the plans are equal)."""
    name, kind, start = step["name"], step["kind"], bool(step.get("start", False))
    deadline = {"deadline": step.get("deadline"), "on_deadline": step.get("on_deadline")}
    try:
        if kind == "action":
            nxt = step.get("next")
            wf.step(name=name, next=nxt, start=start, retry=_retry(step), **deadline)(_handler(step, catalog))
            if "compensation" in step:
                undo = step["compensation"]
                wf.compensation(name, retry=_retry(undo), name=undo["handler"])(_handler(undo, catalog))
        elif kind == "timer":
            wf.timer(name, next=step["next"], delay=step.get("delay"), until=step.get("until"), start=start,
                     **deadline)
        elif kind == "wait":
            wf.wait(name, signals=step.get("signals"), timeout=step.get("timeout"), on_timeout=step.get("on_timeout"),
                    messages=step.get("messages"), correlation=step.get("correlation"), start=start,
                    payloads=_models(step, "payloads", catalog), **deadline)
        elif kind == "task":
            _add_task(wf, step, catalog, start)
        elif kind == "external":
            wf.external(name, topic=step["topic"], next=step["next"], inputs=step.get("inputs"),
                        errors=step.get("errors"), retry=_retry(step), start=start)
        elif kind == "fork":
            wf.fork(name, branches=step.get("branches"), map_over=step.get("map_over"), branch=step.get("branch"),
                    max_items=step.get("max_items", 10_000), start=start)
        elif kind == "join":
            wf.join(name, fork=step["fork"], next=step["next"], need=step.get("need", "all"))
        else:
            wf.child(workflow=step["workflow"], next=step["next"], name=name, on_failure=step.get("on_failure"),
                     cancel_with_parent=step.get("cancel_with_parent", True),
                     start=start)(_handler(step, catalog))
    except DefinitionError as exc:
        raise located(str(exc), ("steps", n), marks) from None


def _retry(step: dict[str, Any]) -> Retry:
    """A step's `retry` (an action's, a compensation's or an external step's), with Retry's defaults."""
    r = step.get("retry", {})
    return Retry(max_attempts=r.get("max_attempts", 3), backoff=r.get("backoff", 1.0),
                 multiplier=r.get("multiplier", 2.0), max_backoff=r.get("max_backoff", 60.0))


def _models(step: dict[str, Any], key: str, catalog: Catalog | None) -> dict[str, Any] | None:
    """The payload models a step names (route name -> model name), from the catalog (`_check_catalog` has
    made sure it has them)."""
    if catalog is None:
        return None
    return {route: catalog.models[name] for route, name in (step.get(key) or {}).items()} or None


_TASK_FIELDS = ("description", "assignee", "owner", "priority", "due", "follow_up", "reminder", "escalate_to_user",
                "escalate_to_group", "expire", "on_expire", "require_version_stability")


def _add_task(wf: DocumentWorkflow, step: dict[str, Any], catalog: Catalog | None, start: bool) -> None:
    """A human task step; its decision payloads name pydantic models registered in the catalog."""
    payloads = _models(step, "payloads", catalog)
    extra = {k: step[k] for k in _TASK_FIELDS if k in step}
    for key in ("candidate_users", "candidate_groups", "show"):
        if key in step:
            extra[key] = step[key]
    wf.task(step["name"], title=step["title"], decisions=step["decisions"], payloads=payloads, start=start,
            **extra)
