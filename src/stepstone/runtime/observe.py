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
from collections.abc import Callable
from contextlib import AbstractContextManager
from contextvars import ContextVar
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


class _Seen:
    """One step attempt or one commit under observation: the `with` block of `step` and `commit`. A
    class rather than a generator-based manager: both run on every step, and the generator and its
    wrapper cost about 1 µs each time (docs/performance.md, "Less Python a step")."""

    __slots__ = ("_began", "_end", "_failure", "_fields", "_spans", "_token", "outcome", "span")

    def __init__(self, spans: AbstractContextManager[Span], end: Callable[[float, str], None], failure: str,
                 fields: dict[str, object] | None = None) -> None:
        self._spans = spans
        self._end = end
        self._failure = failure
        self._fields = fields
        self.outcome = "ok"

    def __enter__(self) -> _Seen:
        self._began = time.perf_counter()
        self.span = self._spans.__enter__()
        self._token = None if self._fields is None else log_fields.set(self._fields)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: Any) -> bool | None:
        if kind is not None:
            self.outcome = self._failure
        try:
            if self._token is not None:
                log_fields.reset(self._token)
            self._end(time.perf_counter() - self._began, self.outcome)
        finally:
            exited = self._spans.__exit__(kind, error, tb)  # the span records the block's error
        return exited

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


def step(workflow: Any, instance: InstanceView, run: RunStep, command: CommandView) -> _Seen:
    """Observe one step attempt: its span (when tracing is on), its log fields, the recorders' call."""
    spans = tracing.span(f"stepstone.step {workflow.id}.{run.step}", {
        "workflow": workflow.id, "version": workflow.version, "step": run.step, "position": instance.position,
        "attempt": run.attempt, "instance_id": instance.id, "command": command.kind,
    }) if tracing.enabled() else tracing.NOT_TRACED

    def end(seconds: float, outcome: str) -> None:
        for r in _recorders:
            r.step(workflow.id, run.step, seconds, outcome)

    fields = {"instance": instance.id, "position": instance.position, "step": run.step, "attempt": run.attempt,
              "workflow": workflow.id}
    return _Seen(spans, end, "crashed", fields)


def commit(instance: InstanceView, decision: Decision) -> _Seen:
    """Observe one commit: its span (when tracing is on) and the recorders' call."""
    settle = decision.settle.state
    spans = tracing.span("stepstone.commit", {"instance_id": instance.id, "position": instance.position,
                                              "settle": settle}) if tracing.enabled() else tracing.NOT_TRACED

    def end(seconds: float, outcome: str) -> None:
        for r in _recorders:
            r.commit(outcome, str(settle), seconds)

    return _Seen(spans, end, "error")
