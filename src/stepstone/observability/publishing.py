"""Spans of the outbox relay: one `stepstone.publish <type>` span per event handed to the broker, a child of
the trace the event was staged in (its `trace_context`, the instance's), so a consumer that reads the
`traceparent` header continues the same trace."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry import propagate
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from stepstone.observability.tracing import tracer

__all__ = ["publish_spans"]


@dataclass
class _Spans:
    spans: list[Span]

    def results(self, results: Sequence[Any]) -> None:
        for span, result in zip(self.spans, results, strict=False):
            outcome = getattr(getattr(result, "outcome", None), "value", str(getattr(result, "outcome", "")))
            span.set_attribute("stepstone.outcome", str(outcome))
            if getattr(result, "error", None):
                span.set_status(Status(StatusCode.ERROR, str(result.error)[:500]))


@contextmanager
def publish_spans(batch: Sequence[Any], broker: str) -> Iterator[_Spans]:
    spans = []
    for event in batch:
        parent = propagate.extract(event.trace_context) if isinstance(event.trace_context, dict) else None
        spans.append(tracer.start_span(
            f"stepstone.publish {event.type}", context=parent, kind=SpanKind.PRODUCER,
            attributes={"stepstone.event_id": str(event.event_id), "stepstone.event_type": event.type,
                        "stepstone.instance_id": str(event.instance_id), "messaging.system": broker},
        ))
    try:
        yield _Spans(spans)
    finally:
        for span in spans:
            span.end()
