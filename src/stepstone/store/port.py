"""The store port: what the runtime and the client need from persistence.

`PostgresStore` is the adapter; nothing outside `stepstone.store` speaks SQL.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from stepstone.core.model import CommandView, Decision, InstanceView


@dataclass(frozen=True)
class Pin:
    scope: str
    definition_id: str
    version: int
    plan_hash: str


@dataclass(frozen=True)
class Claim:
    """A claimed command with its instance snapshot, the lease token and the db clock."""

    instance: InstanceView
    command: CommandView
    pin: Pin
    token: Any
    now: datetime
    business_key: str | None = None


@dataclass(frozen=True)
class Committed:
    """A commit that applied (`conflict` False), or one refused because another position changed
    the shared state first: then nothing was written and `state` / `state_version` are current."""

    continuation: int | None
    committed_at: datetime
    state_version: int = 0
    conflict: bool = False
    state: Any = None


@dataclass(frozen=True)
class CommitRequest:
    """One segment's commit waiting to be flushed: the claim, the command it settles, the decision,
    the visit that emitted its events and the state version the decision was made on."""

    claim: Claim
    command_id: int
    decision: Decision
    visit: int
    state_version: int = 0


@dataclass(frozen=True)
class NewInstance:
    id: str
    pin: Pin
    state: Any
    start_step: str
    business_key: str | None
    idempotency_key: str | None
    fingerprint: str
    actor: str | None = None


class Store(Protocol):
    async def claim(self, limit: int, lease_seconds: float, worker: str) -> list[Claim]: ...
    async def commit(self, request: CommitRequest, *, lease_seconds: float, worker: str) -> Committed | None: ...
    async def commit_many(
        self, requests: list[CommitRequest], *, lease_seconds: float, worker: str
    ) -> list[Committed | None]: ...
    async def renew(self, held: dict[tuple[str, str], Any], lease_seconds: float) -> set[tuple[str, str]]: ...
    async def release(self, instance_id: str, position: str, token: Any) -> bool: ...
    async def defer(self, instance_id: str, position: str, token: Any, reason: str) -> bool: ...
    async def note_error(self, instance_id: str, token: Any, error: str) -> bool: ...
    async def next_available(self) -> float | None: ...
    async def register(self, pin: Pin, plan: dict[str, Any]) -> None: ...
    async def start(self, new: NewInstance) -> tuple[str, bool]: ...
    async def signal(
        self, instance_id: str, name: str, payload: Any, *, dedup_key: str | None, fingerprint: str, actor: str | None,
        position: str = "",
    ) -> int: ...
    async def cancel(self, instance_id: str, reason: str, actor: str | None) -> str: ...
    async def retry(self, instance_id: str, actor: str | None) -> None: ...
    async def get(self, instance_id: str) -> dict[str, Any]: ...
    async def status(self, instance_id: str) -> str: ...
    async def history(self, instance_id: str) -> list[dict[str, Any]]: ...
    async def list(
        self,
        *,
        status: str | None,
        definition: str | None,
        business_key: str | None,
        after: tuple[datetime, str] | None,
        limit: int,
    ) -> list[dict[str, Any]]: ...
    async def db_now(self) -> datetime: ...
    async def close(self) -> None: ...
