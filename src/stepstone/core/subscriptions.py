"""A wait that takes messages subscribes to them when it is entered (`Subscribe`)."""

from __future__ import annotations

import json
from typing import Any

from stepstone.core.effects import Effect, RecordHistory, Subscribe
from stepstone.core.limits import MAX_INDEXED_NAME
from stepstone.core.model import JSON
from stepstone.core.plan import Step
from stepstone.core.task_spec import lookup


def key_text(value: Any) -> str:
    """The correlation key of a value, one text on every path that makes a key (a wait entered) or matches
    one (a publish from Python, the HTTP API, the CLI): a string as it is, anything else its compact JSON
    text, keys sorted. `str` made `True` of a boolean state value and `{'a': 1}` of a map, which no JSON
    client publishing `true` or `{"a":1}` could match."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def correlation_key(step: Step, state: JSON) -> str | None:
    """The key the wait's messages are correlated by, read from the state once as it is entered (`key_text`);
    None when the wait takes no messages or the state has no value there, or an empty text (no publish can
    give an empty key: the wait would wait for a message that cannot come)."""
    if not step.messages or step.correlation is None:
        return None
    key = lookup(state, step.correlation)
    return None if key is None or key == "" else key_text(key)


def key_problem(step: Step, key: str | None) -> str | None:
    """Why the wait cannot subscribe with `key`, if it cannot."""
    if key is None or len(key) <= MAX_INDEXED_NAME:
        return None
    return (f"wait step {step.name!r}: correlation key {step.correlation!r} from the state has {len(key):,} "
            f"characters; at most {MAX_INDEXED_NAME} are indexed")


def subscribe(step: Step, visit: int, key: str | None) -> list[Effect]:
    """The subscriptions of a wait that takes messages, by `correlation_key`; none when it takes none."""
    if not step.messages or step.correlation is None:
        return []
    if key is None:
        return [RecordHistory("NO_CORRELATION_KEY", step.name, visit, {"field": step.correlation})]
    return [Subscribe(tuple(sorted(step.messages)), key, visit)]
