"""What a worker tells observers about its steps and commits: OpenTelemetry spans, and the recorders
`stepstone.observability.metrics` installs (Prometheus). Costs a no-op span when nothing is configured.

    with observe.step(workflow, instance, run, command) as seen:   # span stepstone.step <wf>.<step>
        result = await run_handler(...)
        seen.result(result)
    with observe.commit(instance, decision) as seen:               # span stepstone.commit
        committed = await commit(...)
        seen.result(committed)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from opentelemetry.trace import Span

from stepstone.core.model import CommandView, Decision, InstanceView, RunStep, StepFailed, StepSucceeded
from stepstone.observability import tracing

__all__ = ["Recorder", "add_recorder", "commit", "log_fields", "remove_recorder", "step"]

log_fields: ContextVar[dict[str, object] | None] = ContextVar("stepstone_log_fields", default=None)
"""The instance, position, step and attempt of the step running in this context (for JSON logs)."""


class Recorder(Protocol):
    """Receives one call per step attempt, per commit and per claim (metrics)."""

    def step(self, workflow: str, step: str, seconds: float, outcome: str) -> None: ...
    def commit(self, outcome: str, settle: str, seconds: float) -> None: ...
    def claimed(self, workflow: str, kind: str, reclaimed: bool) -> None: ...
    def first_step(self, workflow: str, seconds: float) -> None: ...


_recorders: list[Recorder] = []


def add_recorder(recorder: Recorder) -> None:
    if recorder not in _recorders:
        _recorders.append(recorder)


def remove_recorder(recorder: Recorder) -> None:
    if recorder in _recorders:
        _recorders.remove(recorder)


def claimed(workflow: str, command: CommandView, now: datetime | None = None,
            created_at: datetime | None = None) -> None:
    """A command was claimed; `reclaimed` when an earlier claim of it never settled (its lease expired).
    The first claim of a START tells how long the instance waited for its first step (database clock)."""
    waited = None
    if command.kind == "START" and command.claims == 1 and now is not None and created_at is not None:
        waited = max((now - created_at).total_seconds(), 0.0)
    for r in _recorders:
        r.claimed(workflow, command.kind, command.claims > 1)
        if waited is not None:
            r.first_step(workflow, waited)


@dataclass
class _Seen:
    span: Span
    outcome: str = "ok"

    def result(self, value: Any) -> None:
        if isinstance(value, StepFailed):
            self.outcome = "failed"
            tracing.failed(self.span, value.error_type, value.message)
        elif isinstance(value, StepSucceeded):
            self.outcome = "ok"
            if value.next:
                self.span.set_attribute("stepstone.next", value.next)
        elif value is None:
            self.outcome = "fenced"
            self.span.set_attribute("stepstone.outcome", "fenced")
        elif getattr(value, "conflict", False):
            self.outcome = "conflict"
            self.span.set_attribute("stepstone.outcome", "conflict")
        else:
            self.span.set_attribute("stepstone.outcome", "ok")


@contextmanager
def step(workflow: Any, instance: InstanceView, run: RunStep, command: CommandView) -> Iterator[_Seen]:
    attributes = {"workflow": workflow.id, "version": workflow.version, "step": run.step,
                  "position": instance.position, "attempt": run.attempt, "instance_id": instance.id,
                  "command": command.kind}
    began = time.perf_counter()
    fields = log_fields.set({"instance": instance.id, "position": instance.position, "step": run.step,
                             "attempt": run.attempt, "workflow": workflow.id})
    with tracing.span(f"stepstone.step {workflow.id}.{run.step}", attributes) as current:
        seen = _Seen(current)
        try:
            yield seen
        except BaseException:
            seen.outcome = "crashed"
            raise
        finally:
            log_fields.reset(fields)
            seconds = time.perf_counter() - began
            for r in _recorders:
                r.step(workflow.id, run.step, seconds, seen.outcome)


@contextmanager
def commit(instance: InstanceView, decision: Decision) -> Iterator[_Seen]:
    settle = decision.settle.state
    began = time.perf_counter()
    with tracing.span("stepstone.commit", {"instance_id": instance.id, "position": instance.position,
                                           "settle": settle}) as current:
        seen = _Seen(current)
        try:
            yield seen
        except BaseException:
            seen.outcome = "error"
            raise
        finally:
            seconds = time.perf_counter() - began
            for r in _recorders:
                r.commit(seen.outcome, str(settle), seconds)
