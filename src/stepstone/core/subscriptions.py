"""A wait that takes messages subscribes to them when it is entered (`Subscribe`)."""

from __future__ import annotations

from stepstone.core.effects import Effect, RecordHistory, Subscribe
from stepstone.core.model import JSON
from stepstone.core.plan import Step
from stepstone.core.task_spec import lookup


def subscribe(step: Step, visit: int, state: JSON) -> list[Effect]:
    """The subscriptions of a wait that takes messages; none when it takes none."""
    if not step.messages or step.correlation is None:
        return []
    key = lookup(state, step.correlation)
    if key is None:
        return [RecordHistory("NO_CORRELATION_KEY", step.name, visit, {"field": step.correlation})]
    return [Subscribe(tuple(sorted(step.messages)), str(key), visit)]
