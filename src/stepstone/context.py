"""Durable context: values the caller binds, carried with its commands into every handler they lead to.

    tenant = contextvars.ContextVar("tenant")
    user = contextvars.ContextVar("user")
    stepstone.context.register(tenant)                   # bound again around the handlers, on any worker
    stepstone.context.register(user, identity=True)      # recorded with the command, never bound ...
    stepstone.context.register(user, identity=True, safe=True)   # ... unless declared safe

When the caller starts an instance or sends a signal, `capture()` takes the registered variables'
values and the OpenTelemetry trace context (W3C `traceparent`), and the store keeps them with the
instance (a start) or the command (a signal). A worker that claims a command binds them again around
the handler it runs (`bound`): the signal's context for the steps that signal leads to, the start's
for every other step, timers and retries included, on any worker. Values must be JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate

__all__ = ["DurableContext", "bound", "capture", "durable", "recorded", "register"]

_MISSING = object()


@dataclass(frozen=True)
class _Entry:
    var: ContextVar[Any]
    name: str
    carried: bool


class DurableContext:
    """The registered context variables of a process (`durable` is the one stepstone uses)."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def register(
        self, var: ContextVar[Any], name: str | None = None, *, identity: bool = False, safe: bool = False,
    ) -> None:
        """Carry `var` with every command the caller makes. An `identity` (the acting user, a token) is
        recorded for audit but never bound into a handler unless it is also declared `safe`."""
        key = name or var.name
        if not key:
            raise ValueError("a durable context variable needs a name")
        self._entries[key] = _Entry(var, key, carried=not identity or safe)

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def capture(self) -> dict[str, Any] | None:
        """The current trace context and registered values, as JSON; None when there is nothing."""
        doc: dict[str, Any] = {}
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        if carrier:
            doc["trace"] = carrier
        values: dict[str, Any] = {}
        for entry in self._entries.values():
            value = entry.var.get(_MISSING)
            if value is _MISSING:
                continue
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise TypeError(f"durable context variable {entry.name!r} holds {type(value).__name__}, "
                                "which is not JSON") from None
            values[entry.name] = value
        if values:
            doc["vars"] = values
        return doc or None

    def bound(self, doc: Any) -> AbstractContextManager[None]:
        """Bind a captured context for the block: its trace context as the current one, and every
        registered variable it holds that may be carried. Unknown names are ignored."""
        if not doc:  # no context was captured, as for most instances: nothing to bind, nothing to build
            return _NOTHING_BOUND
        return self._bound(doc)

    @contextmanager
    def _bound(self, doc: Any) -> Iterator[None]:
        tokens: list[tuple[ContextVar[Any], Token[Any]]] = []
        attached = None
        if isinstance(doc, dict):
            carrier = doc.get("trace")
            if isinstance(carrier, dict) and carrier:
                attached = otel_context.attach(propagate.extract(carrier))
            for name, value in (doc.get("vars") or {}).items():
                entry = self._entries.get(name)
                if entry is not None and entry.carried:
                    tokens.append((entry.var, entry.var.set(value)))
        try:
            yield
        finally:
            for var, token in reversed(tokens):
                var.reset(token)
            if attached is not None:
                otel_context.detach(attached)


_NOTHING_BOUND: AbstractContextManager[None] = nullcontext()


def recorded(doc: Any) -> dict[str, Any]:
    """Every value a captured context recorded, identities included (for audit, never for handlers)."""
    return dict(doc.get("vars") or {}) if isinstance(doc, dict) else {}


durable = DurableContext()
register = durable.register
capture = durable.capture
bound = durable.bound
