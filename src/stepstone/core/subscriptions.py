"""A wait that takes messages subscribes to them when it is entered (`Subscribe`)."""

from __future__ import annotations

from stepstone.core.effects import Effect, RecordHistory, Subscribe
from stepstone.core.limits import MAX_INDEXED_NAME
from stepstone.core.model import JSON
from stepstone.core.plan import Step
from stepstone.core.task_spec import lookup


def key_problem(step: Step, state: JSON) -> str | None:
    """Why the wait cannot subscribe with the correlation key the state gives, if it cannot."""
    if not step.messages or step.correlation is None:
        return None
    key = lookup(state, step.correlation)
    if key is None or len(str(key)) <= MAX_INDEXED_NAME:
        return None
    return (f"wait step {step.name!r}: correlation key {step.correlation!r} from the state has {len(str(key)):,} "
            f"characters; at most {MAX_INDEXED_NAME} are indexed")


def subscribe(step: Step, visit: int, state: JSON) -> list[Effect]:
    """The subscriptions of a wait that takes messages; none when it takes none."""
    if not step.messages or step.correlation is None:
        return []
    key = lookup(state, step.correlation)
    if key is None:
        return [RecordHistory("NO_CORRELATION_KEY", step.name, visit, {"field": step.correlation})]
    return [Subscribe(tuple(sorted(step.messages)), str(key), visit)]
