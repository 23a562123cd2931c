"""The store port of the management API and the web UI: reads across instances, and API tokens.

    ManagementStore   scoped lists (instances, history, commands, dead letters, outbox events,
                      definitions), the plan of a pin, the scope of an instance, and API tokens

History and command rows come back redacted as every view shows them (the instance's registration says
what is sensitive); `redactions` gives the same redaction for what other reads return (state, tasks).

The adapter is `stepstone.store.management.PostgresManagement`; `stepstone.api` is typed against this
protocol only. A `scopes` argument is the scopes the caller may see, or None for every scope.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from stepstone.core.redaction import Redaction

__all__ = ["ROLES", "ManagementStore", "TokenRecord"]

ROLES = ("viewer", "task_worker", "operator", "admin")
"""The roles a token grants in its scope, weakest first."""


@dataclass(frozen=True)
class TokenRecord:
    """An API token as stored: never the token itself, only what it grants."""

    id: str
    name: str
    role: str
    scope: str
    created_at: datetime | None = None
    created_by: str | None = None
    revoked_at: datetime | None = None
    groups: tuple[str, ...] = ()
    """The groups its user belongs to, for the task inbox (candidate groups)."""

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "groups": list(self.groups)}


class ManagementStore(Protocol):
    async def instance_scope(self, instance_id: str) -> str | None: ...
    async def instance_scopes(self, instance_ids: Sequence[str]) -> dict[str, str]:
        """The scope of each instance, keyed by the ids as given (any spelling of a UUID; missing ones left out)."""
        ...
    async def redactions(self, instance_ids: Sequence[str]) -> dict[str, Redaction]:
        """The redaction of each instance its registration stores, keyed by the ids as given (any spelling of a
        UUID: the caller looks its own id up; missing ones left out)."""
        ...
    async def shown_tasks(self, tasks: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Tasks (`TaskInfo` fields) as every view shows them: shown fields and completion payloads redacted."""
        ...
    async def instance_stamp(self, instance_id: str) -> tuple[str, datetime] | None: ...
    async def instances_page(
        self, scopes: Sequence[str] | None, *, statuses: Sequence[str] = (), definition: str | None,
        business_key: str | None, after: tuple[datetime, str] | None, limit: int, include_archived: bool = False,
    ) -> list[dict[str, Any]]: ...
    async def instance_counts(
        self, scopes: Sequence[str] | None, definition: str | None, cap: int, include_archived: bool = False, *,
        business_key: str | None = None,
    ) -> dict[str, int]: ...
    async def history_page(
        self, instance_id: str, *, after: int, limit: int, failed_only: bool
    ) -> list[dict[str, Any]]: ...
    async def commands_page(
        self, instance_id: str, *, after: int, limit: int, states: Sequence[str] | None
    ) -> list[dict[str, Any]]: ...
    async def dead_commands_page(
        self, scopes: Sequence[str] | None, *, before: int | None, limit: int, definition: str | None = None
    ) -> list[dict[str, Any]]: ...
    async def instance_outbox(self, instance_id: str, *, after: int, limit: int) -> list[dict[str, Any]]: ...
    async def definitions_page(
        self, scopes: Sequence[str] | None, *, after: tuple[str, str, int] | None, limit: int
    ) -> list[dict[str, Any]]: ...
    async def definition_plan(self, scope: str, definition_id: str, version: int) -> dict[str, Any] | None: ...

    async def create_token(
        self, token_id: uuid.UUID, name: str, token_hash: str, role: str, scope: str, created_by: str | None,
        groups: tuple[str, ...] = (),
    ) -> TokenRecord: ...
    async def list_tokens(self, *, include_revoked: bool) -> list[TokenRecord]: ...
    async def revoke_token(self, token_id: str) -> TokenRecord | None: ...
    async def token_by_hash(self, token_hash: str) -> TokenRecord | None: ...
    async def active_token_count(self) -> int: ...
