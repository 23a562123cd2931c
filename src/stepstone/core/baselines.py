"""The state change a STEP_COMPLETED entry records: an RFC 6902 patch, or a full baseline.

A patch larger than `PATCH_LIMIT` bytes of JSON is not worth replaying: the entry records
`patch: None` and a STATE_BASELINE entry after it holds the whole new state, so the state at any
point of the history is the last baseline (the start, a replay, an oversized change) plus the
patches after it.
"""

from __future__ import annotations

from typing import Any

from stepstone.core import json_text
from stepstone.core.effects import RecordHistory

__all__ = ["PATCH_LIMIT", "step_completed"]

PATCH_LIMIT = 64 * 1024
"""Bytes of JSON above which a state change is logged as a baseline instead of a patch."""


def step_completed(step: str, visit: int, attempt: int, patch: list[dict[str, Any]],
                   after: Any) -> tuple[RecordHistory, ...]:
    """The STEP_COMPLETED entry of a step whose state change is `patch` (`diff(before, after)`, which
    the caller computes once for this entry and for the commit's SetState), and a baseline when needed."""
    if json_text.size(patch) <= PATCH_LIMIT:
        return (RecordHistory("STEP_COMPLETED", step, visit, {"attempt": attempt, "patch": patch}),)
    return (
        RecordHistory("STEP_COMPLETED", step, visit, {"attempt": attempt, "patch": None, "oversized": True}),
        RecordHistory("STATE_BASELINE", step, visit, {"state": after, "reason": "oversized change"}),
    )
