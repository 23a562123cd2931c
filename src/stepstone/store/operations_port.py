"""The port of the operations (`stepstone.ops`): what queries, retention and repair need of the store.

Rows come back as plain dicts; `stepstone.ops` turns them into typed results. The adapter is
`stepstone.store.operations_pg.PostgresOperations`, built by `stepstone.store.factory.operations_store`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Protocol

from stepstone.core.model import STATUSES
from stepstone.errors import InvalidInput
from stepstone.instants import checked

__all__ = ["InstanceFilter", "OperationsStore"]


@dataclass(frozen=True)
class InstanceFilter:
    """Which instances an operation works on; every field optional, all given ones must hold.

    `business_key_contains` is a case-insensitive substring; `since`/`until` bound the creation
    time, `updated_since`/`updated_until` the last change. Archived instances are left out unless
    `include_archived` (one that was retried after its archival shows again)."""

    status: tuple[str, ...] = ()
    workflow: str | None = None
    version: int | None = None
    scope: str | None = None
    business_key: str | None = None
    business_key_contains: str | None = None
    parent: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    updated_since: datetime | None = None
    updated_until: datetime | None = None
    include_archived: bool = False

    def __post_init__(self) -> None:
        for field in ("since", "until", "updated_since", "updated_until"):
            checked(getattr(self, field), field.replace("_", " "))
        unknown = sorted(set(self.status) - set(STATUSES))
        if unknown:  # it matched nothing, silently
            raise InvalidInput(f"status must be among {', '.join(STATUSES)}, got {', '.join(map(repr, unknown))}",
                               what="status")

    def as_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}

    @property
    def narrows(self) -> bool:
        """Whether it keeps fewer than every instance: `include_archived` only widens, and an empty
        `business_key_contains` is in every key. A bulk action refuses a filter that does not narrow
        (acting on every instance must be said with a filter that names them, e.g. every status)."""
        widened = replace(self, include_archived=False,
                          business_key_contains=self.business_key_contains or None)
        return widened != InstanceFilter()


class OperationsStore(Protocol):
    """What `stepstone.ops` needs of the store."""

    schema: str

    async def find_instances(
        self, where: InstanceFilter, after: tuple[datetime, str] | None, limit: int
    ) -> list[dict[str, Any]]: ...
    async def count_instances(self, where: InstanceFilter) -> dict[str, int]: ...
    async def instance(self, instance_id: str) -> dict[str, Any]: ...
    async def instance_commands(self, instance_id: str) -> list[dict[str, Any]]: ...
    async def instance_outbox(self, instance_id: str) -> list[dict[str, Any]]: ...
    async def instance_extra(self, instance_id: str) -> dict[str, Any]: ...
    async def retrying(self, instance_id: str) -> list[dict[str, Any]]: ...
    async def history_page(
        self, instance_id: str, after: int, limit: int, failed_only: bool
    ) -> list[dict[str, Any]]: ...
    async def full_history(self, instance_id: str) -> list[dict[str, Any]]: ...
    async def open_commands(self, instance_id: str | None, limit: int,
                            where: InstanceFilter | None = None) -> list[dict[str, Any]]: ...
    async def busy_commands(self, instance_id: str | None, limit: int,
                            where: InstanceFilter | None = None) -> list[dict[str, Any]]: ...
    async def stuck(self, older_than: timedelta, limit: int,
                    where: InstanceFilter | None = None) -> list[dict[str, Any]]: ...
    async def retention_batch(self, phase: str, limit: int, after: str | None, dry_run: bool,
                              workflow: str | None = None, scope: str | None = None) -> dict[str, Any]: ...
    async def retention_outbox(self, limit: int, dry_run: bool) -> int: ...
    async def retention_messages(self, limit: int, dry_run: bool) -> int: ...
    async def retention_policies(self) -> list[dict[str, Any]]: ...
    async def set_retention_policy(
        self, workflow: str, status_class: str, retain_for: timedelta | None, purge_after: timedelta | None
    ) -> dict[str, Any]: ...
    async def try_retention_lock(self) -> Any: ...
    async def release_retention_lock(self, holder: Any) -> None: ...
    async def retry_many(self, ids: list[str], actor: str | None) -> list[dict[str, Any]]: ...
    async def cancel_many(
        self, ids: list[str], reason: str, actor: str | None, compensate: bool = False,
    ) -> list[dict[str, Any]]: ...
    async def command_of(self, instance_id: str, command_id: int) -> dict[str, Any] | None: ...
    async def replay(
        self, instance_id: str, step: str, state: Any, baseline: Any, expected_seq: int, from_seq: int,
        actor: str | None, cause: Any = None,
    ) -> dict[str, Any]: ...
    async def role_privileges(self) -> dict[str, Any]: ...
    async def grants(self, role: str, *, read_only: bool) -> list[str]: ...
    async def apply_grants(self, statements: list[str]) -> None: ...
    async def db_now(self) -> datetime: ...
