"""What a worker tells observers about its steps and commits: OpenTelemetry spans, the recorders
`stepstone.observability.metrics` installs (Prometheus), and one log line per failure a commit settles
(a retry, a failed instance, a dead letter). Costs a no-op span when nothing is configured.

    with observe.step(workflow, instance, run, command) as seen:   # span stepstone.step <wf>.<step>
        result = await run_handler(...)
        seen.result(result)
    with observe.commit(instance, decision, workflow_id) as seen:  # span stepstone.commit
        committed = await commit(...)
        seen.result(committed)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from contextvars import ContextVar
from datetime import datetime
from typing import Any, Protocol

from opentelemetry.trace import Span

from stepstone.core.effects import AdvanceSaga, IfStopped, MovePosition, RecordHistory
from stepstone.core.failures import traceback_text
from stepstone.core.model import FAILED, CommandView, Decision, InstanceView, RunStep, StepFailed, StepSucceeded
from stepstone.observability import tracing

__all__ = ["Recorder", "add_recorder", "branch_failure", "commit", "log_fields", "remove_recorder", "step"]

log = logging.getLogger("stepstone.worker")
_FAILURES = frozenset({"RETRY", "FAILED", "DEAD"})
"""The settlements logged: a failed attempt to be retried, a failed position or compensation, a dead letter."""

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
    wrapper cost about 1 µs each time (docs/performance-history.md, "Less Python a step")."""

    __slots__ = ("_began", "_end", "_failure", "_fields", "_shown", "_spans", "_token", "outcome", "span")

    def __init__(self, spans: AbstractContextManager[Span], end: Callable[[float, str], None], failure: str,
                 fields: dict[str, object] | None = None, shown: Callable[[str], str] = str) -> None:
        self._spans = spans
        self._end = end
        self._failure = failure
        self._fields = fields
        self._shown = shown  # a failure's message as history stores it (redacted)
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
            tracing.failed(self.span, value.error_type, self._shown(value.message))
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

    fields = {"workflow": workflow.id, "instance": instance.id, "position": instance.position, "step": run.step,
              "attempt": run.attempt}  # the order of docs/observability.md and of the failure lines (`_log_failure`)
    return _Seen(spans, end, "crashed", fields,
                 lambda message: workflow.redaction.failure_text(message, instance.state, command))


def commit(instance: InstanceView, decision: Decision, workflow: str = "") -> _Seen:
    """Observe one commit: its span (when tracing is on), the recorders' call, and a log line when it
    settled a failure."""
    settle = decision.settle.state
    spans = tracing.span("stepstone.commit", {"instance_id": instance.id, "position": instance.position,
                                              "settle": settle}) if tracing.enabled() else tracing.NOT_TRACED

    def end(seconds: float, outcome: str) -> None:
        for r in _recorders:
            r.commit(outcome, str(settle), seconds)
        # Committed: logged once, by the worker whose commit won; a branch's failure once the worker has
        # read whether it stopped the instance (`branch_failure`).
        if outcome == "ok" and settle in _FAILURES and _stop_entry(decision) is None:
            _log_failure(workflow, instance, decision)

    return _Seen(spans, end, "error")


class _StopsReader(Protocol):
    async def stopped_by(self, instance_id: str, position: str, step: str | None, visit: int | None) -> bool: ...


def _stop_entry(decision: Decision) -> RecordHistory | None:
    """The INSTANCE_FAILED entry of a branch failure whose commit decides whether it stops the instance."""
    chosen = decision.first(IfStopped)
    if chosen is None:
        return None
    return next((e for e in chosen.stopped if isinstance(e, RecordHistory) and e.kind == "INSTANCE_FAILED"), None)


async def branch_failure(store: _StopsReader, workflow: str, instance: InstanceView, decision: Decision) -> None:
    """After a commit that failed a branch which its join might pass over: log it at ERROR when it stopped the
    instance, at WARNING when the join passed over it (one round trip, on such failures only)."""
    entry = _stop_entry(decision)
    if entry is None:
        return
    try:
        stopped: bool | None = await store.stopped_by(instance.id, instance.position, entry.step, entry.visit)
    except Exception:  # noqa: BLE001 - a log line must not fail the segment; it says it does not know
        stopped = None
    _log_failure(workflow, instance, decision, stopped)


def _log_failure(workflow: str, instance: InstanceView, decision: Decision, stopped: bool | None = None) -> None:
    """WARNING for an attempt that will be retried, a dead-lettered signal, a branch failure its join
    passed over or a saga's failed step (it compensates); ERROR for a failed position that failed the
    instance (the root's; a branch's when its join could no longer be met, or when that could not be read)
    or a compensation given up. With the step's fields, as its own lines."""
    settle = decision.settle
    moved = next((e for e in decision.of(MovePosition) if e.status == FAILED), None)
    history = decision.of(RecordHistory)
    step = moved.step if moved is not None else next((h.step for h in history if h.step), instance.step)
    attempt = next((h.data["attempt"] for h in history if isinstance(h.data, dict) and "attempt" in h.data), None)
    fields: dict[str, object] = {"workflow": workflow, "instance": instance.id, "position": instance.position,
                                 "step": step, **({} if attempt is None else {"attempt": attempt})}
    what = "compensation of step" if history and history[0].kind.startswith("COMPENSATION") else "step"
    where = f"{workflow} instance {instance.id}" + (f" position {instance.position!r}" if instance.position else "")
    if settle.state == "RETRY":
        level, message = logging.WARNING, (f"{what} {step} of {where} failed (attempt {attempt}), "
                                           f"retrying in {settle.retry_delay or 0:g} s: {settle.reason}")
    elif moved is not None and any(a.op == "begin" for a in decision.of(AdvanceSaga)):
        # A saga's step failed for good: the instance does not fail, it compensates (an ERROR only if
        # the compensation itself gives up, below).
        level, message = logging.WARNING, (f"step {step} of {where} failed, compensation starts: "
                                           f"{settle.reason}")
    elif moved is not None:
        dead = "its command was dead-lettered: " if settle.state == "DEAD" else ""
        # A branch's failure stops the instance only when its join can no longer be met, which the commit
        # decided (IfStopped) and the worker read after it (`branch_failure`).
        whether = {None: " (the instance fails with it only if its join can no longer be met)" if instance.position
                   else "", True: "; its join can no longer be met: the instance fails",
                   False: "; its join does not need it: the other branches go on"}[stopped]
        level = logging.WARNING if stopped is False else logging.ERROR
        message = f"{where} failed at step {step}{whether}: {dead}{settle.reason}"
    elif settle.state == "DEAD":
        level, message = logging.WARNING, f"a command of {where} was dead-lettered: {settle.reason}"
    else:
        level, message = logging.ERROR, f"{what} {step} of {where} gave up: {settle.reason}"
    # Where the handler raised, once per failed attempt: the stored (redacted) failure as a traceback, never
    # the exception itself, whose message the workflow's redaction has not seen.
    trace = next((t for h in history if (t := traceback_text(h.data)) is not None), None)
    token = log_fields.set(fields)
    try:
        if trace is None:
            log.log(level, "%s", message)
        elif log.isEnabledFor(level):
            file, line, function, _ = log.findCaller()
            record = log.makeRecord(log.name, level, file, line, "%s", (message,), None, function)
            record.exc_text = trace  # every logging.Formatter appends it as it would a traceback
            log.handle(record)
    finally:
        log_fields.reset(token)
