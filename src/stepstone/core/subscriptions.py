"""A wait that takes messages subscribes to them when it is entered (`Subscribe`)."""

from __future__ import annotations

import json
import math
from typing import Any

from stepstone.core.effects import Effect, RecordHistory, Subscribe
from stepstone.core.limits import MAX_INDEXED_NAME
from stepstone.core.model import JSON
from stepstone.core.plan import Step
from stepstone.core.task_spec import lookup


def key_text(value: Any) -> str:
    """The correlation key of a value, one text on every path that makes a key (a wait entered) or matches
    one (a publish from Python, the HTTP API, the CLI): a string as it is, anything else its compact JSON
    text, keys sorted, with an integral number as an integer (`2.0` is `2`, in a map or list too: JSON has
    one kind of number, and a float field holding 2.0 must meet a client's 2). `str` made `True` of a
    boolean state value and `{'a': 1}` of a map, which no JSON client publishing `true` or `{"a":1}` could
    match."""
    if isinstance(value, str):
        return value
    return json.dumps(_integral(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def _integral(value: Any) -> Any:
    """`value` with every finite integral float made the integer it is (-0.0 is 0)."""
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else value
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_integral(v) for v in value]
    return value


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
