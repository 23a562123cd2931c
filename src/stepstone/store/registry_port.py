"""The registry port: what the runtime, the client and the operations need from the definitions registry.

`PostgresStore.definitions` is the adapter (`stepstone.store.registry.PostgresRegistry`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from stepstone.core.pin import Pin

__all__ = ["SERVED_WITHIN_SECONDS", "DefinitionRecord", "DefinitionsPort", "RefusedInput", "StrandedPin"]

SERVED_WITHIN_SECONDS = 300.0
"""A pin counts as served by a live worker when a worker heartbeated it within this (5 minutes)."""


@dataclass(frozen=True)
class DefinitionRecord:
    """One registry row, without document text."""

    scope: str
    definition_id: str
    version: int
    kind: str
    status: str
    plan_hash: str
    state_model: str | None
    signal_names: list[str]
    registered_at: datetime
    active: bool = False
    document_digest: str | None = None


@dataclass(frozen=True)
class StrandedPin:
    """Instances that may still run whose pinned plan no live worker serves."""

    pin: Pin
    instances: int
    deferred_commands: int
    last_served: datetime | None
    """The last heartbeat on record; None when there is none (never served, or its workers stopped cleanly)."""


@dataclass(frozen=True)
class RefusedInput:
    """A schedule whose stored input the version its ticks now start refuses: each tick would be skipped."""

    name: str
    scope: str
    problem: str


class DefinitionsPort(Protocol):
    """The registry's operations (see `stepstone.store.registry` for the rules)."""

    async def record(
        self, pin: Pin, plan: dict[str, Any], *, kind: str = "CODE", status: str = "AVAILABLE",
        state_model: str | None = None, input_schema: Any = None, document: str | None = None,
        document_format: str | None = None,
    ) -> str: ...
    async def find(self, scope: str, definition_id: str, version: int) -> dict[str, Any]: ...
    async def transition(
        self, scope: str, definition_id: str, version: int, to: str, *, plan_hash: str | None = None
    ) -> str: ...
    async def publish(self, pin: Pin) -> str: ...
    async def claim_publication(self, pin: Pin) -> uuid.UUID | None: ...
    async def complete_publication(self, pin: Pin, token: uuid.UUID) -> None: ...
    async def activate(
        self, scope: str, definition_id: str, version: int, *, target_scope: str | None = None,
        actor: str | None = None,
    ) -> list[RefusedInput]: ...
    async def deactivate(self, scope: str, definition_id: str) -> list[RefusedInput]: ...
    async def activations(
        self, scope: str | None = None, definition_id: str | None = None
    ) -> list[dict[str, Any]]: ...
    async def select_version(self, scope: str, definition_id: str) -> tuple[str, int, str] | None: ...
    async def child_pin(self, child_id: str, definition_id: str) -> tuple[int, str] | None: ...
    async def records(
        self, *, scope: str | None = None, definition_id: str | None = None, status: str | None = None
    ) -> list[DefinitionRecord]: ...
    async def document(self, scope: str, definition_id: str, version: int) -> tuple[str, str]: ...
    async def heartbeat(self, worker_id: str, pins: list[Pin]) -> None: ...
    async def resume_deferred(self, pins: list[Pin]) -> int: ...
    async def forget_worker(self, worker_id: str) -> None: ...
    async def stranded(self, within_seconds: float, scope: str | None = None, *,
                       scopes: Sequence[str] | None = None) -> list[StrandedPin]:
        """Per pin, the instances of `scope` (or of `scopes`; None: every scope) no live worker serves."""
        ...
    async def served(self, within_seconds: float) -> list[dict[str, Any]]: ...
    async def migration_view(self, instance_id: str) -> dict[str, Any]: ...
    async def pinned_contract(self, instance_id: str) -> dict[str, Any] | None: ...
    async def migration_candidates(
        self, definition_id: str, version: int, scope: str | None, limit: int,
        after: tuple[datetime, str] | None = None,
    ) -> list[tuple[str, datetime]]:
        """A page of (id, created_at), oldest first, after `after` (a created_at and an id) when given."""
        ...
    async def reserve_command_seq(self) -> int: ...
    async def check_admission(self, instance_id: str, to_pin: Pin) -> None: ...
    async def migrate_instance(
        self, instance_id: str, *, order_seq: int, from_pin: Pin, state_version: int, to_pin: Pin,
        step_map: dict[str, str], positions: list[dict[str, Any]], state: Any, actor: str | None,
        served_within: float = SERVED_WITHIN_SECONDS,
    ) -> tuple[str, int | None]: ...
