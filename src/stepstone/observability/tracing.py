"""OpenTelemetry spans of stepstone, through the OpenTelemetry API (a no-op until an SDK is configured).

    stepstone.start <workflow>    client: an instance started (its trace context is kept with it)
    stepstone.signal <name>       client: a signal sent (its trace context is kept with the command)
    stepstone.step <workflow>.<step>   worker: one attempt of a step's handler, a child of the start's
                                  or the signal's span, on whichever worker runs it
    stepstone.commit              worker: the fenced commit of a segment (outcome: ok, fenced, conflict)
    stepstone.publish <type>      relay: an outbox event handed to the broker

Attributes use the `stepstone.` prefix: workflow, version, step, position, attempt, instance_id.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

__all__ = ["NOT_TRACED", "enabled", "failed", "span", "tracer"]

tracer = trace.get_tracer("stepstone")


def span(name: str, attributes: dict[str, Any] | None = None, *,
         kind: SpanKind = SpanKind.INTERNAL) -> AbstractContextManager[Span]:
    """A span around the block; an exception escaping it is recorded and marks it as an error.

    Until an application sets a tracer provider, the API's proxy provider hands out no-op spans; the
    block then gets one shared non-recording span and nothing else is built (the attributes, the
    proxy's context managers and the context attach/detach cost ~15% of a worker's CPU per step)."""
    if not enabled():
        return NOT_TRACED
    attrs = {f"stepstone.{k}": v for k, v in (attributes or {}).items() if v is not None}
    return tracer.start_as_current_span(name, attributes=attrs, kind=kind)


NOT_TRACED: AbstractContextManager[Span] = nullcontext(trace.INVALID_SPAN)
_FROM_ENVIRONMENT = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ


def enabled() -> bool:
    """Whether spans go anywhere (callers on the hot path ask first, so as not to build a name and
    attributes for a span that records nothing). `trace.get_tracer_provider()` answers it too, but reads the
    environment on every call while no provider is set (5 µs, twice a step); the API's module global
    answers in a dictionary lookup, and the public call stays the fallback if that global moves."""
    if _FROM_ENVIRONMENT:
        return True
    provider = getattr(trace, "_TRACER_PROVIDER", _UNKNOWN)
    if provider is _UNKNOWN:
        return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    return provider is not None


_UNKNOWN = object()


def failed(current: Span, error_type: str, message: str) -> None:
    """Mark a span as failed without an exception object (a handler's error, already described)."""
    current.set_status(Status(StatusCode.ERROR, f"{error_type}: {message}"[:500]))
    current.set_attribute("stepstone.error_type", error_type)
