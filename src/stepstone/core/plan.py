"""Immutable workflow plans: the validated structure of a definition.

A plan is built once, at registration, from the authoring layer's description.
Its hash covers structure (steps, transitions, signals, timers, retry policies),
never handler bodies, so a pinned instance can tell whether a node runs the same
graph it started on.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

END = "$end"
"""The pseudo-step that ends an instance; a transition to it completes the instance."""

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,127}$")

StepKind = Literal["action", "timer", "wait"]


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
        if self.multiplier < 1:
            found.append(f"{where}: multiplier must be at least 1")
        return found


@dataclass(frozen=True)
class Step:
    """One node of the graph.

    action: runs a handler, then goes to one of `next` (END ends the instance).
    timer:  waits `delay_seconds`, or until the instant in state field `until`, then goes to next[0].
    wait:   waits for one of `signals` (name -> next step); after `timeout_seconds` goes to `on_timeout`.
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

    def targets(self) -> tuple[str, ...]:
        """Every step this one may go to."""
        if self.kind == "wait":
            extra = (self.on_timeout,) if self.on_timeout else ()
            return tuple(self.signals.values()) + extra
        return self.next

    def describe(self) -> dict[str, Any]:
        """The structure that enters the plan hash and the stored plan document."""
        out: dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.kind == "action":
            out["next"] = list(self.next)
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
        else:
            out.update(
                signals=dict(sorted(self.signals.items())),
                timeout_seconds=self.timeout_seconds,
                on_timeout=self.on_timeout,
            )
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
        problems = _problems(definition_id, version, start, steps)
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
    return bool(_NAME.match(name))


def _problems(definition_id: str, version: int, start: str | None, steps: list[Step]) -> list[str]:
    found: list[str] = []
    if not valid_name(definition_id):
        found.append(f"invalid definition id {definition_id!r} (letters, digits, _ . -; at most 128)")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        found.append("version must be a positive integer")
    names = [s.name for s in steps]
    found.extend(f"step {dup!r} is defined twice" for dup in sorted({n for n in names if names.count(n) > 1}))
    found.extend(f"invalid step name {s.name!r}" for s in steps if not valid_name(s.name))
    known = set(names)
    if not steps:
        found.append("no steps")
    if start is None:
        found.append("no start step (mark one with start=True)")
    elif start not in known:
        found.append(f"start step {start!r} is not defined")
    for s in steps:
        found.extend(_step_problems(s, known))
    if start in known:
        unreachable = sorted(known - _reachable(start, {s.name: s for s in steps}))
        if unreachable:
            found.append("unreachable steps: " + ", ".join(unreachable))
    return found


def _step_problems(s: Step, known: set[str]) -> list[str]:
    found = [
        f"step {s.name!r} goes to unknown step {t!r}"
        for t in s.targets()
        if t != END and t not in known
    ]
    if s.kind == "action":
        found.extend(s.retry.problems(f"step {s.name!r}"))
    elif s.kind == "timer":
        if (s.delay_seconds is None) == (s.until is None):
            found.append(f"timer step {s.name!r} needs exactly one of delay or until")
        if s.delay_seconds is not None and s.delay_seconds < 0:
            found.append(f"timer step {s.name!r} has a negative delay")
        if len(s.next) != 1:
            found.append(f"timer step {s.name!r} needs exactly one next step")
    else:
        if not s.signals:
            found.append(f"wait step {s.name!r} accepts no signal")
        found.extend(f"wait step {s.name!r}: invalid signal name {sig!r}" for sig in s.signals if not valid_name(sig))
        if (s.timeout_seconds is None) != (s.on_timeout is None):
            found.append(f"wait step {s.name!r}: timeout and on_timeout go together")
        if s.timeout_seconds is not None and s.timeout_seconds < 0:
            found.append(f"wait step {s.name!r} has a negative timeout")
    return found


def _reachable(start: str, steps: dict[str, Step]) -> set[str]:
    seen = {start}
    todo = [start]
    while todo:
        for t in steps[todo.pop()].targets():
            if t in steps and t not in seen:
                seen.add(t)
                todo.append(t)
    return seen
