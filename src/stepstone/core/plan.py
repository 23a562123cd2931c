"""Immutable workflow plans: the validated structure of a definition.

A plan is built once, at registration, from the authoring layer's description.
Its hash covers structure (steps, transitions, signals, timers, retry policies),
never handler bodies, so a pinned instance can tell whether a node runs the same
graph it started on.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from stepstone.core.bounds import is_whole
from stepstone.core.limits import MAX_INT4
from stepstone.core.task_spec import TaskSpec
from stepstone.core.timestamps import within_max

END = "$end"
DEADLINE_KINDS = frozenset({"action", "wait", "timer"})
"""The kinds a step deadline may be declared on. Leaving a child, human or external task step early
would leave the child or the open task behind (tasks have their own due date and expiry)."""
"""The pseudo-step that ends an instance; a transition to it completes the instance."""

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,127}$")

StepKind = Literal["action", "timer", "wait", "fork", "join", "child", "external", "task"]

DEFAULT_MAX_ITEMS = 10_000
"""The most branches one map fork may start, unless the step says otherwise."""


class PlanError(ValueError):
    """A definition that cannot become a plan; the message names every problem."""


@dataclass(frozen=True)
class RetryPolicy:
    """How a failing action step is retried before its instance fails."""

    max_attempts: int = 3
    initial_backoff: float = 1.0
    multiplier: float = 2.0
    max_backoff: float = 60.0
    non_retryable: tuple[str, ...] = ()

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after the given failed attempt (1-based)."""
        try:
            growth = self.multiplier ** (attempt - 1)
        except OverflowError:  # float pow raises rather than returning inf; the cap applies long before
            growth = float("inf")
        if self.initial_backoff == 0:
            return 0.0
        return float(min(self.max_backoff, self.initial_backoff * growth))

    def problems(self, where: str) -> list[str]:
        found = []
        if self.max_attempts < 1:
            found.append(f"{where}: max_attempts must be at least 1")
        if self.initial_backoff < 0 or self.max_backoff < 0:
            found.append(f"{where}: backoffs must not be negative")
        if not self.multiplier >= 1 or math.isinf(self.multiplier):  # NaN and inf too: the registry stores null
            found.append(f"{where}: multiplier must be a number of at least 1, got {self.multiplier}")
        found.extend(too_long(f"{where}: backoff", self.initial_backoff))
        found.extend(too_long(f"{where}: max_backoff", self.max_backoff))
        return found


@dataclass(frozen=True)
class Compensation:
    """A step's compensation handler: its name (for the alert) and its own retry policy."""

    name: str
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def describe(self) -> dict[str, Any]:
        r = self.retry
        return {"name": self.name, "retry": {
            "max_attempts": r.max_attempts, "initial_backoff": r.initial_backoff, "multiplier": r.multiplier,
            "max_backoff": r.max_backoff, "non_retryable": sorted(r.non_retryable)}}


@dataclass(frozen=True)
class Step:
    """One node of the graph.

    action: runs a handler, then goes to one of `next` (END ends the instance).
    timer:  waits `delay_seconds`, or until the instant in state field `until`, then goes to next[0].
    wait:   waits for one of `signals` (name -> next step); after `timeout_seconds` goes to `on_timeout`.
    fork:   starts parallel branches: `branches` (name -> first step), or one per item of the state
            list `map_over`, each starting at `branch_step` (at most `max_items`); waits at its join.
    join:   the end of the branches of `fork`: when `need` of them reached it (0: all), the fork's
            position goes on to next[0]; branches still running are cancelled.
    task:   opens a human task (`task`) and waits for one of its `decisions` (name -> next step);
            its due date, reminder and expiry are timers of the position (`on_expire` on expiry).
    wait may also take `messages` (name -> next step), correlated by the state value at `correlation`.
    child:  runs a handler that returns the input of a child instance of `workflow`, starts it in
            the step's commit and waits for its end; then next[0], or `on_failure` when it failed
            or was cancelled. `cancel_with_parent` False abandons the child when the parent is cancelled.
    external: opens a task on `topic` for outside workers (its payload the state, or only the state
            fields `inputs`) and waits for its completion, whose variables are merged into the
            state; then next[0]. A business error goes to `errors[code]` (an incident when the
            code is not there); a failure retries per `retry` (attempts, backoff), then an incident.
    """

    name: str
    kind: StepKind
    next: tuple[str, ...] = ()
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    delay_seconds: float | None = None
    until: str | None = None
    signals: Mapping[str, str] = field(default_factory=dict)
    timeout_seconds: float | None = None
    on_timeout: str | None = None
    branches: Mapping[str, str] = field(default_factory=dict)
    map_over: str | None = None
    branch_step: str | None = None
    max_items: int = DEFAULT_MAX_ITEMS
    fork: str | None = None
    need: int = 0
    workflow: str | None = None
    on_failure: str | None = None
    cancel_with_parent: bool = True
    topic: str | None = None
    inputs: tuple[str, ...] | None = None
    errors: Mapping[str, str] = field(default_factory=dict)
    compensation: Compensation | None = None
    """Undoes what a completed action step did when its saga is compensated (`core.saga`)."""
    deadline_seconds: float | None = None
    """The step (an action's every attempt, a wait, a timer) must be left within this, from entering
    it; then `on_deadline`, or it fails (`DEADLINE_KINDS`)."""
    on_deadline: str | None = None
    decisions: Mapping[str, str] = field(default_factory=dict)
    task: TaskSpec | None = None
    messages: Mapping[str, str] = field(default_factory=dict)
    correlation: str | None = None

    def branch_starts(self) -> tuple[str, ...]:
        """The first steps of a fork's branches."""
        if self.kind != "fork":
            return ()
        return tuple(self.branches.values()) if self.branches else ((self.branch_step,) if self.branch_step else ())

    def targets(self) -> tuple[str, ...]:
        """Every step this one may go to."""
        deadline = (self.on_deadline,) if self.on_deadline else ()
        return self._kind_targets() + deadline

    def _kind_targets(self) -> tuple[str, ...]:
        if self.kind == "wait":
            extra = (self.on_timeout,) if self.on_timeout else ()
            return tuple(self.signals.values()) + tuple(self.messages.values()) + extra
        if self.kind == "task":
            expire = (self.task.on_expire,) if self.task is not None and self.task.on_expire else ()
            return tuple(self.decisions.values()) + expire
        if self.kind == "child" and self.on_failure:
            return (*self.next, self.on_failure)
        if self.kind == "external":
            return (*self.next, *self.errors.values())
        return self.next

    def describe(self) -> dict[str, Any]:
        """The structure that enters the plan hash and the stored plan document."""
        out: dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.kind in ("action", "external"):
            out["next"] = list(self.next)
            if self.kind == "external":
                out.update(topic=self.topic, inputs=None if self.inputs is None else list(self.inputs),
                           errors=dict(sorted(self.errors.items())))
            r = self.retry
            out["retry"] = {
                "max_attempts": r.max_attempts,
                "initial_backoff": r.initial_backoff,
                "multiplier": r.multiplier,
                "max_backoff": r.max_backoff,
                "non_retryable": sorted(r.non_retryable),
            }
        elif self.kind == "timer":
            out.update(next=list(self.next), delay_seconds=self.delay_seconds, until=self.until)
        elif self.kind == "fork":
            out.update(branches=dict(sorted(self.branches.items())), map_over=self.map_over,
                       branch_step=self.branch_step, max_items=self.max_items)
        elif self.kind == "join":
            out.update(fork=self.fork, need=self.need, next=list(self.next))
        elif self.kind == "child":
            out.update(workflow=self.workflow, next=list(self.next), on_failure=self.on_failure,
                       cancel_with_parent=self.cancel_with_parent)
        elif self.kind == "task":
            out.update(decisions=dict(sorted(self.decisions.items())),
                       task=None if self.task is None else self.task.describe())
        else:
            out.update(
                signals=dict(sorted(self.signals.items())),
                timeout_seconds=self.timeout_seconds,
                on_timeout=self.on_timeout,
            )
            if self.messages:  # only when used: the hash of a plan without messages stays as it was
                out.update(messages=dict(sorted(self.messages.items())), correlation=self.correlation)
        if self.compensation is not None:  # only when declared: the hash of other plans stays as it was
            out["compensation"] = self.compensation.describe()
        if self.deadline_seconds is not None:
            out["deadline"] = {"seconds": self.deadline_seconds, "on_deadline": self.on_deadline}
        return out


@dataclass(frozen=True)
class Plan:
    """A validated, immutable workflow graph. Build it with `Plan.build`."""

    definition_id: str
    version: int
    start: str
    steps: Mapping[str, Step]
    plan_hash: str

    @property
    def child_workflows(self) -> frozenset[str]:
        """Every workflow some child step of this plan starts."""
        return frozenset(s.workflow for s in self.steps.values() if s.workflow)

    def join_of(self, fork: str) -> Step:
        return next(s for s in self.steps.values() if s.kind == "join" and s.fork == fork)

    def reaches(self, first: str, stop: str) -> bool:
        """Whether some path from step `first` arrives at step `stop` (a nested fork jumps to its join)."""
        joins = {s.fork: s.name for s in self.steps.values() if s.kind == "join" and s.fork}
        return _reaches(first, stop, dict(self.steps), joins)

    @cached_property
    def compensable(self) -> bool:
        """Whether some step declares a compensation: then a step that fails for good compensates."""
        return any(s.compensation is not None for s in self.steps.values())

    @property
    def start_deadline(self) -> float | None:
        """An action start step's deadline, which the start itself schedules: the start runs that step
        without entering it (a wait or timer start step schedules its own when the start enters it)."""
        first = self.steps[self.start]
        return first.deadline_seconds if first.kind == "action" else None

    @property
    def signal_names(self) -> frozenset[str]:
        """Every signal name some wait step of this plan accepts."""
        return frozenset(n for s in self.steps.values() for n in s.signals)

    def document(self) -> dict[str, Any]:
        """The plan as JSON: what the store keeps beside the pin."""
        return {
            "definition_id": self.definition_id,
            "version": self.version,
            "start": self.start,
            "steps": [s.describe() for s in self.steps.values()],
            "signals": sorted(self.signal_names),
        }

    @classmethod
    def build(cls, definition_id: str, version: int, start: str | None, steps: list[Step]) -> Plan:
        """Validate the graph and freeze it; raises PlanError naming every problem."""
        problems = plan_problems(definition_id, version, start, steps)
        if problems or start is None:
            raise PlanError(f"workflow {definition_id!r} v{version}: " + "; ".join(problems))
        by_name = {s.name: s for s in steps}
        body = {
            "definition_id": definition_id,
            "version": version,
            "start": start,
            "steps": [s.describe() for s in sorted(steps, key=lambda s: s.name)],
        }
        digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
        return cls(definition_id, version, start, by_name, digest.hexdigest())


def valid_name(name: str) -> bool:
    return isinstance(name, str) and bool(_NAME.match(name))


def _shape_problems(steps: list[Step]) -> list[str]:
    """Fields of the wrong type (from Python authoring; a document's schema catches them first): the
    checks after these compare and hash them, and would fail with Python's own errors."""
    found: list[str] = []
    for s in steps:
        label = f"step {s.name!r}"
        found.extend(f"{label}: next must name steps, got {t!r}" for t in s.next if not isinstance(t, str))
        for field_name in ("signals", "messages", "branches", "decisions", "errors"):
            pairs = getattr(s, field_name, {})
            if not isinstance(pairs, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                          for k, v in pairs.items()):
                found.append(f"{label}: {field_name} must map names to step names, got {pairs!r}")
        names = ("on_timeout", "on_failure", "on_deadline", "branch_step", "map_over", "until", "fork", "workflow",
                 "correlation", "topic")
        found.extend(f"{label}: {f} must be a name, got {getattr(s, f)!r}"
                     for f in names if not isinstance(getattr(s, f), str | None))
        found.extend(f"{label}: {f} must be a whole number, got {getattr(s, f)!r}"
                     for f in ("max_items", "need") if not is_whole(getattr(s, f), -MAX_INT4, MAX_INT4))
    return found


def plan_problems(definition_id: str, version: int, start: str | None, steps: list[Step], *,
                  start_mark: str = "start=True") -> list[str]:
    """Every problem that keeps these steps from becoming a plan, one text each (none: `Plan.build` takes
    them); a text about a step names it (``step 'a' ...``, ``wait step 'w' ...``). `start_mark` is how the
    author marks the start step (a document spells it its own way)."""
    found: list[str] = []
    if shape := _shape_problems(steps):
        return shape
    if not valid_name(definition_id):
        found.append(f"invalid definition id {definition_id!r} (letters, digits, _ . -; at most 128)")
    if not is_whole(version, 1, MAX_INT4):  # the registry's and the instances' version columns are int4
        found.append(f"version must be a whole number from 1 to {MAX_INT4:,}, got {version!r}")
    names = [s.name for s in steps]
    found.extend(f"step {dup!r} is defined twice" for dup in sorted({n for n in names if names.count(n) > 1}))
    found.extend(f"invalid step name {s.name!r}" for s in steps if not valid_name(s.name))
    known = set(names)
    if not steps:
        found.append("no steps")
    if start is None:
        found.append(f"no start step (mark one with {start_mark})")
    elif start not in known:
        found.append(f"start step {start!r} is not defined")
    by_name = {s.name: s for s in steps}
    for s in steps:
        found.extend(_step_problems(s, known))
        if s.kind == "join" and s.fork in by_name:
            found.extend(_need_problems(s, by_name[s.fork]))
    if start in known:
        found.extend(_flow_problems(start, {s.name: s for s in steps}))
    return found


def too_long(what: str, seconds: float | None) -> list[str]:
    """A problem when a duration is longer than a thousand years or not a number: the timer it sets would
    lie beyond what the driver holds (a delay of 1e300 failed each commit that set it, until the command
    was dead-lettered; one of inf fired at once)."""
    if seconds is None or within_max(seconds):
        return []
    return [f"{what} must be at most a thousand years, got {seconds} s"]


STEP_DURATIONS = (("deadline", "deadline_seconds"), ("delay", "delay_seconds"), ("timeout", "timeout_seconds"))
"""A step's durations: the field a workflow document names each by, and the Step's attribute."""


def long_durations(s: Step) -> list[tuple[str, str]]:
    """(field, problem) for each of a step's durations longer than a thousand years (or not a number)."""
    return [(field, problem) for field, attr in STEP_DURATIONS
            for problem in too_long(f"step {s.name!r}: its {field}", getattr(s, attr))]


def _step_problems(s: Step, known: set[str]) -> list[str]:
    found = [] if s.compensation is None else s.compensation.retry.problems(f"compensation of step {s.name!r}")
    if s.compensation is not None and s.kind != "action":
        found.append(f"step {s.name!r}: only an action step can declare a compensation")
    if s.deadline_seconds is not None and (s.kind not in DEADLINE_KINDS or s.deadline_seconds < 0):
        kinds = ", ".join(sorted(DEADLINE_KINDS))
        found.append(f"step {s.name!r}: a deadline is for {kinds} steps and must not be negative")
    if s.on_deadline is not None and s.deadline_seconds is None:
        found.append(f"step {s.name!r}: on_deadline without a deadline")
    found.extend(problem for _, problem in long_durations(s))
    found += [
        f"step {s.name!r} goes to unknown step {t!r}"
        for t in s.targets()
        if t != END and t not in known
    ]
    found.extend(_KIND_PROBLEMS[s.kind](s))
    return found


def _timer_problems(s: Step) -> list[str]:
    found = []
    if (s.delay_seconds is None) == (s.until is None):
        found.append(f"timer step {s.name!r} needs exactly one of delay or until")
    if s.delay_seconds is not None and s.delay_seconds < 0:
        found.append(f"timer step {s.name!r} has a negative delay")
    if len(s.next) != 1:
        found.append(f"timer step {s.name!r} needs exactly one next step")
    return found


def _wait_problems(s: Step) -> list[str]:
    found = []
    if not s.signals and not s.messages:
        found.append(f"wait step {s.name!r} accepts no signal")
    if s.messages and not s.correlation:
        found.append(f"wait step {s.name!r} takes messages but names no correlation (a state field)")
    found.extend(f"wait step {s.name!r}: invalid message name {m!r}" for m in s.messages if not valid_name(m))
    found.extend(f"wait step {s.name!r}: invalid signal name {sig!r}" for sig in s.signals if not valid_name(sig))
    if (s.timeout_seconds is None) != (s.on_timeout is None):
        found.append(f"wait step {s.name!r}: timeout and on_timeout go together")
    if s.timeout_seconds is not None and s.timeout_seconds < 0:
        found.append(f"wait step {s.name!r} has a negative timeout")
    return found


def _join_problems(s: Step) -> list[str]:
    found = []
    if len(s.next) != 1:
        found.append(f"join step {s.name!r} needs exactly one next step")
    if s.need < 0:
        found.append(f"join step {s.name!r}: need must be 0 (all) or a positive count")
    return found


def _child_problems(s: Step) -> list[str]:
    found = []
    if not s.workflow or not valid_name(s.workflow):
        found.append(f"child step {s.name!r} names no valid workflow")
    if len(s.next) != 1:
        found.append(f"child step {s.name!r} needs exactly one next step")
    return found


def _external_problems(s: Step) -> list[str]:
    found = s.retry.problems(f"step {s.name!r}")
    if not s.topic or not valid_name(s.topic):
        found.append(f"external step {s.name!r} needs a topic (letters, digits, _ . -; at most 128)")
    if len(s.next) != 1:
        found.append(f"external step {s.name!r} needs exactly one next step")
    found.extend(f"external step {s.name!r}: invalid error code {c!r}" for c in s.errors if not valid_name(c))
    found.extend(f"external step {s.name!r}: invalid input field {f!r}" for f in s.inputs or () if not f)
    return found


def _reaches(first: str, stop: str, steps: dict[str, Step], joins: dict[str, str]) -> bool:
    """Whether some path from `first` arrives at `stop` (a nested fork jumps to its own join)."""
    seen, todo = set(), [first]
    while todo:
        name = todo.pop()
        if name == stop:
            return True
        step = steps.get(name)
        if step is None or name in seen:
            continue
        seen.add(name)
        if step.kind == "fork" and name in joins:
            todo.extend(steps[joins[name]].next)
        elif step.kind != "join":
            todo.extend(step.targets())
    return False


def _fork_problems(s: Step) -> list[str]:
    found = []
    if bool(s.branches) == bool(s.map_over):
        found.append(f"fork step {s.name!r} needs either branches or map_over (and not both)")
    if s.map_over is not None and not s.branch_step:
        found.append(f"fork step {s.name!r} maps over {s.map_over!r} but names no branch step")
    found.extend(f"fork step {s.name!r}: invalid branch name {b!r}" for b in s.branches if not valid_name(b))
    if s.max_items < 1:
        found.append(f"fork step {s.name!r}: max_items must be at least 1")
    return found


def _task_problems(s: Step) -> list[str]:
    if s.task is None:
        return [f"task step {s.name!r} declares no task"]
    found = s.task.problems(f"task step {s.name!r}", s.decisions)
    found.extend(f"task step {s.name!r}: invalid decision name {d!r}" for d in s.decisions if not valid_name(d))
    return found


_KIND_PROBLEMS: dict[str, Callable[[Step], list[str]]] = {
    "task": _task_problems,
    "action": lambda s: s.retry.problems(f"step {s.name!r}"),
    "timer": _timer_problems,
    "wait": _wait_problems,
    "fork": _fork_problems,
    "join": _join_problems,
    "child": _child_problems,
    "external": _external_problems,
}


def _need_problems(join: Step, fork: Step) -> list[str]:
    """A join that needs more branches than its fork has (a map's item count is known only at run time)."""
    have = len(fork.branches)
    return [f"join step {join.name!r} needs {join.need} branches; fork {fork.name!r} has {have}"] \
        if have and join.need > have else []


def _flow_problems(start: str, steps: dict[str, Step]) -> list[str]:
    """Each step belongs to exactly one chain: the main flow, or one fork's branches, which must
    reach that fork's join and never the end. A fork's chain goes on after its join."""
    found: list[str] = []
    joins: dict[str, str] = {}
    for j in steps.values():
        if j.kind != "join":
            continue
        if j.fork not in steps or steps[j.fork].kind != "fork":
            found.append(f"join step {j.name!r} names no fork"
                         + (f": {j.fork!r} is not a fork step" if j.fork else ""))
        elif j.fork in joins:
            found.append(f"fork {j.fork!r} has two joins: {joins[j.fork]!r} and {j.name!r}")
        else:
            joins[j.fork] = j.name
    owner: dict[str, str] = {}

    def walk(label: str, firsts: list[str], stop: str | None) -> None:
        todo = list(firsts)
        while todo:
            name = todo.pop()
            if name == stop:
                continue
            if name == END:
                if stop is not None:
                    found.append(f"{label} go to the end; a branch ends at its join {stop!r}")
                continue
            step = steps.get(name)
            if step is None or owner.get(name) == label:
                continue
            if name in owner:
                found.append(f"step {name!r} is in both {owner[name]} and {label}")
                continue
            if step.kind == "join":
                found.append(f"{label} reach join {name!r} outside the branches of its fork")
                continue
            owner[name] = label
            if step.kind != "fork":
                todo.extend(step.targets())
                continue
            join = joins.get(name)
            if join is None:
                found.append(f"fork step {name!r} has no join")
                continue
            starts = step.branch_starts()
            if starts:
                walk(f"the branches of fork {name!r}", list(starts), join)
                for branch, first_step in (step.branches or {"*": starts[0]}).items():
                    if not _reaches(first_step, join, steps, joins):
                        found.append(f"branch {branch!r} of fork {name!r} can never reach its join {join!r}")
            owner[join] = label
            todo.extend(steps[join].next)

    walk("the main flow", [start], None)
    unreachable = sorted(steps.keys() - owner.keys())
    if unreachable:
        found.append("unreachable steps: " + ", ".join(unreachable))
    return found
