"""A pin: which exact plan an instance runs (scope, definition, version and plan hash).

An instance keeps its pin for life; a worker runs a command only when its registry holds the pinned
plan, and defers it otherwise (kind ``NOT_RUNNABLE``) for a node that has it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from stepstone.core.plan import Plan, valid_name
from stepstone.errors import InvalidInput

__all__ = ["DEFAULT_SCOPE", "HasPlan", "Pin", "check_scope", "pin_of"]

DEFAULT_SCOPE = "default"


def check_scope(scope: str) -> str:
    """`scope` if an instance may be started in it: a name, as a workflow document's scope is (a letter or
    `_`, then letters, digits, `_`, `.`, `-`; at most 128). Never `*`, which a token's grant uses for
    every scope: an instance there would be one no scoped token could see, and a grant's wildcard would
    read as its scope. InvalidInput otherwise; the client, the CLI and the API start through it."""
    if not valid_name(scope):
        raise InvalidInput(f"scope {scope!r} is not a scope name: a letter or _, then letters, digits, _, . or - "
                           "(at most 128; '*' means every scope in a token's grant, never an instance's)",
                           what="scope")
    return scope


@dataclass(frozen=True)
class Pin:
    scope: str
    definition_id: str
    version: int
    plan_hash: str

    @property
    def route(self) -> str:
        """The key a command of this pin is queued under once a worker that lacked its plan deferred it
        (the store's command_route): only the workers that name it among the keys they serve take it."""
        return f"{self.definition_id}@{self.version}@{self.plan_hash}"


class HasPlan(Protocol):
    """Anything that carries a plan, such as an authored workflow."""

    @property
    def plan(self) -> Plan: ...


def pin_of(workflow: HasPlan | Plan, scope: str = DEFAULT_SCOPE) -> Pin:
    """The pin of a workflow (or of a plan) in `scope`."""
    plan = workflow if isinstance(workflow, Plan) else workflow.plan
    return Pin(scope, plan.definition_id, plan.version, plan.plan_hash)
