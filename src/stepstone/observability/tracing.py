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

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

__all__ = ["failed", "span", "tracer"]

tracer = trace.get_tracer("stepstone")


@contextmanager
def span(name: str, attributes: dict[str, Any] | None = None, *, kind: SpanKind = SpanKind.INTERNAL) -> Iterator[Span]:
    """A span around the block; an exception escaping it is recorded and marks it as an error."""
    attrs = {f"stepstone.{k}": v for k, v in (attributes or {}).items() if v is not None}
    with tracer.start_as_current_span(name, attributes=attrs, kind=kind) as current:
        yield current


def failed(current: Span, error_type: str, message: str) -> None:
    """Mark a span as failed without an exception object (a handler's error, already described)."""
    current.set_status(Status(StatusCode.ERROR, f"{error_type}: {message}"[:500]))
    current.set_attribute("stepstone.error_type", error_type)
