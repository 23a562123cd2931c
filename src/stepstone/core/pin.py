"""A pin: which exact plan an instance runs (scope, definition, version and plan hash).

An instance keeps its pin for life; a worker runs a command only when its registry holds the pinned
plan, and defers it otherwise (kind ``NOT_RUNNABLE``) for a node that has it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from stepstone.core.plan import Plan

__all__ = ["DEFAULT_SCOPE", "HasPlan", "Pin", "pin_of"]

DEFAULT_SCOPE = "default"


@dataclass(frozen=True)
class Pin:
    scope: str
    definition_id: str
    version: int
    plan_hash: str


class HasPlan(Protocol):
    """Anything that carries a plan, such as an authored workflow."""

    @property
    def plan(self) -> Plan: ...


def pin_of(workflow: HasPlan | Plan, scope: str = DEFAULT_SCOPE) -> Pin:
    """The pin of a workflow (or of a plan) in `scope`."""
    plan = workflow if isinstance(workflow, Plan) else workflow.plan
    return Pin(scope, plan.definition_id, plan.version, plan.plan_hash)
