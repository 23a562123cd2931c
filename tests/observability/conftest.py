"""An in-memory OpenTelemetry exporter for the whole session (the tracer provider is set once per process)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from stepstone.testing import Engine, open_engine
from tests.observability import workflows

sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="the OpenTelemetry SDK is the otel extra (in .[test])")
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

_EXPORTER = InMemorySpanExporter()


class _Armed(SimpleSpanProcessor):
    """Exports only while a test holds the `spans` fixture: the provider outlives it, for the whole session."""

    armed = False

    def on_end(self, span: sdk.ReadableSpan) -> None:
        if self.armed:
            super().on_end(span)


_PROCESSOR = _Armed(_EXPORTER)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    if not isinstance(trace.get_tracer_provider(), sdk.TracerProvider):  # set once per process
        provider = sdk.TracerProvider()
        provider.add_span_processor(_PROCESSOR)
        trace.set_tracer_provider(provider)
    _EXPORTER.clear()
    workflows.SEEN.clear()
    _PROCESSOR.armed = True
    try:
        yield _EXPORTER
    finally:
        _PROCESSOR.armed = False
        _EXPORTER.clear()


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[Engine]:
    async with open_engine(database_url, workflows.registry) as e:
        yield e
