"""The store port: what the runtime and the client need from persistence.

    WorkerStore   what a worker needs: claim, commit, renew, release, defer, listen_due, next_available
    ClientStore   what the client needs: start, signal, cancel, retry, get, list, history
    Store         both, plus the test clock: what `stepstone.store.factory.open_store` returns

`PostgresStore` (`stepstone.store.postgres`) is the adapter and `open_store` the one place it is
built; the runtime, the client and `stepstone.testing` are typed against these protocols only, and the
import contracts in pyproject.toml keep them off the adapter and the driver. Nothing outside
`stepstone.store` speaks SQL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from stepstone.core.model import CommandView, Decision, InstanceView
from stepstone.core.pin import Pin
from stepstone.store.registry_port import DefinitionsPort
from stepstone.store.task_port import TaskStore

__all__ = [
    "Claim",
    "ClientStore",
    "CommitRequest",
    "Committed",
    "DefinitionsPort",
    "HeldCommand",
    "Listener",
    "NewInstance",
    "Pin",
    "Queued",
    "Store",
    "WorkerStore",
]


@dataclass(frozen=True)
class Claim:
    """A claimed command with its instance snapshot, the lease token and the db clock."""

    instance: InstanceView
    command: CommandView
    pin: Pin
    token: Any
    now: datetime
    business_key: str | None = None
    context: Any = None
    """The durable context its handler runs in: the command's (a signal's sender's), else the instance's."""
    instance_created_at: datetime | None = None


@dataclass(frozen=True)
class Committed:
    """A commit that applied (`conflict` False; `state` set when the change was carried onto a state
    another position changed meanwhile, or when the decision changed no state and another position
    moved it on since the claim: the current state either way), or one refused because another
    position changed the same part of the shared state first: then nothing was written and `state` /
    `state_version` are current."""

    continuation: int | None
    committed_at: datetime
    state_version: int = 0
    conflict: bool = False
    state: Any = None


@dataclass(frozen=True)
class Queued:
    """The ready commands queued right behind a claimed one on its position (`WorkerStore.queued_behind`),
    and the instance's shared state and its version, read in the same snapshot: a state that holds what
    every one of those commands' writers committed with it."""

    commands: tuple[CommandView, ...]
    state: Any
    state_version: int


@dataclass(frozen=True)
class HeldCommand:
    """The command a lease token holds on its position, and the step and visit it names now: a
    continuation from a step's own command goes on in that row (migration 0030), so after a commit of
    unknown outcome the same id naming the continuation's step and visit means the commit happened."""

    id: int
    step: str | None
    visit: int | None


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
    fingerprint: str | None
    """Of the input and business key, what a start repeated under the idempotency key is compared with;
    None without a key (nothing compares it)."""
    actor: str | None = None
    deadline_at: datetime | None = None
    deadline_seconds: float | None = None
    """An instance deadline (an instant, or seconds from the start on the database clock): a timer."""
    start_deadline_seconds: float | None = None
    """The start step's own deadline (the plan's): a step deadline timer from the start."""
    context: Any = None
    """What the caller bound when it started (stepstone.context): kept with the instance."""

    @property
    def plain(self) -> bool:
        """No durable context and no deadline: the one-statement start, and one a group can share."""
        return self.context is None and self.deadline_at is None and self.deadline_seconds is None \
            and self.start_deadline_seconds is None


@dataclass(frozen=True)
class NewInstances:
    """Instances of one pinned version started by one statement (`ClientStore.start_many`): the per-item
    lists align by index; the rest is the same for every item (as `NewInstance` has it)."""

    pin: Pin
    start_step: str
    ids: Sequence[str]
    states: Sequence[Any]
    business_keys: Sequence[str | None]
    idempotency_keys: Sequence[str | None]
    fingerprints: Sequence[str | None]
    actor: str | None = None
    deadline_at: datetime | None = None
    deadline_seconds: float | None = None
    start_deadline_seconds: float | None = None
    context: Any = None


class Listener(Protocol):
    """The wake-up connection a worker holds; `close` ends it, a connection already gone included."""

    @property
    def alive(self) -> bool: ...
    async def close(self) -> None: ...


class WorkerStore(Protocol):
    """What a worker needs: the hot path (claim, commit, renew), giving work back, and wake-ups."""

    @property
    def definitions(self) -> DefinitionsPort: ...
    async def register(self, pin: Pin, plan: dict[str, Any], **fields: Any) -> None: ...
    async def claim(self, limit: int, lease_seconds: float, worker: str,
                    definitions: Sequence[str] | None = None) -> list[Claim]: ...
    async def commit(self, request: CommitRequest, *, lease_seconds: float, worker: str) -> Committed | None: ...
    async def commit_many(
        self, requests: list[CommitRequest], *, lease_seconds: float, worker: str
    ) -> list[Committed | None]: ...
    async def held_command(self, instance_id: str, position: str, token: Any) -> HeldCommand | None: ...
    async def settled_by(self, command_id: int, token: Any) -> bool: ...
    async def queued_behind(self, instance_id: str, position: str, command_id: int, limit: int) -> Queued: ...
    async def holds_lease(self, instance_id: str, position: str, token: Any) -> bool: ...
    async def renew(self, held: dict[tuple[str, str], Any], lease_seconds: float) -> set[tuple[str, str]]: ...
    async def release(self, instance_id: str, position: str, token: Any) -> bool: ...
    async def defer(self, instance_id: str, position: str, token: Any, reason: str) -> bool: ...
    async def run_alone(self, instance_id: str, position: str, token: Any) -> int | None: ...
    async def note_error(self, instance_id: str, token: Any, error: str) -> bool: ...
    async def stopped_by(self, instance_id: str, position: str, step: str | None, visit: int | None) -> bool: ...
    async def next_available(self, served: list[str] | None = None) -> float | None: ...
    async def refresh_statistics(self) -> bool: ...
    async def listen_due(self, callback: Callable[[float, str | None], None]) -> Listener: ...
    async def db_now(self) -> datetime: ...


class ClientStore(TaskStore, Protocol):
    """What the client needs: start and steer instances, and read them (and their tasks and messages)."""

    @property
    def definitions(self) -> DefinitionsPort: ...
    async def register(self, pin: Pin, plan: dict[str, Any], **fields: Any) -> None: ...
    async def start(self, new: NewInstance) -> tuple[str, bool]: ...
    async def start_many(self, new: NewInstances) -> list[tuple[str, bool]]: ...
    async def signal(
        self, instance_id: str, name: str, payload: Any, *, dedup_key: str | None, fingerprint: str, actor: str | None,
        position: str = "", context: Any = None,
    ) -> int: ...
    async def cancel(self, instance_id: str, reason: str, actor: str | None) -> str: ...
    async def cancel_saga(
        self, instance_id: str, reason: str, actor: str | None, *, compensate: bool
    ) -> tuple[str, str]: ...
    async def compensations(self, instance_id: str) -> list[dict[str, Any]]: ...
    async def retry(self, instance_id: str, actor: str | None) -> None: ...
    async def get(self, instance_id: str) -> dict[str, Any]: ...
    async def status(self, instance_id: str) -> str: ...
    async def history(self, instance_id: str) -> list[dict[str, Any]]: ...
    async def listen_settled(self, callback: Callable[[str], None]) -> Listener: ...
    async def list(
        self,
        *,
        status: str | None = None,
        definition: str | None = None,
        business_key: str | None = None,
        after: tuple[datetime, str] | None = None,
        limit: int = 50,
        scope: str | None = None,
        include_archived: bool = False,
    ) -> list[dict[str, Any]]: ...
    async def close(self) -> None: ...


class Store(WorkerStore, ClientStore, Protocol):
    """The whole port, as `open_store` returns it; `move_clock`, `clock_offset` and `set_clock_offset` are the
    test hooks on the db clock."""

    url: str
    """Where the store is (may hold a password: redact it before showing it)."""
    schema: str

    async def move_clock(self, seconds: float) -> datetime: ...
    async def clock_offset(self) -> float: ...
    async def set_clock_offset(self, seconds: float) -> datetime: ...
