"""The store port of human tasks, correlated messages and start-or-signal (migration 0007).

`ClientStore` includes `TaskStore`; `PostgresStore` implements it in `store/postgres_tasks.py`.
Outcomes come back as the words the SQL functions answer with; the client turns them into typed
results and errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Protocol

from stepstone.instants import checked

__all__ = ["InboxMode", "TaskFilter", "TaskQuery", "TaskStore"]

InboxMode = Literal["inbox", "assigned", "candidate", "all"]


@dataclass(frozen=True)
class TaskFilter:
    """Narrows an inbox: a workflow, a lowest priority, due before an instant, offered to a group, text
    in the title (case-insensitive), a scope, or any of several scopes. Every field is optional.

    Follow-up dates put a task aside until then: `follow_up_before` keeps only tasks without a follow-up
    date or with one at or before that instant; `hide_later_follow_ups` does the same with the
    database's now, read when the query runs (what a saved filter wants: "what is for me today")."""

    workflow: str | None = None
    priority_at_least: int | None = None
    due_before: datetime | None = None
    candidate_group: str | None = None
    text: str | None = None
    follow_up_before: datetime | None = None
    hide_later_follow_ups: bool = False

    def __post_init__(self) -> None:
        checked(self.due_before, "due before")
        checked(self.follow_up_before, "follow up before")
    scope: str | None = None
    scopes: tuple[str, ...] | None = None
    """Any of these scopes (and `scope`, when both are given): the HTTP API's callers limited to some."""



@dataclass(frozen=True)
class TaskQuery:
    """Which open tasks: the mode's user and groups, the filter, and the keyset page."""

    mode: InboxMode = "inbox"
    user: str | None = None
    groups: Sequence[str] | None = None
    where: TaskFilter = TaskFilter()
    after: tuple[int, datetime, str] | None = None
    limit: int = 50


class TaskStore(Protocol):
    async def get_task(self, task_id: str) -> dict[str, Any]: ...
    async def list_tasks(self, query: TaskQuery) -> list[dict[str, Any]]: ...
    async def count_tasks(self, query: TaskQuery) -> int: ...
    async def instance_tasks(self, instance_id: str) -> list[dict[str, Any]]: ...
    async def task_assign(
        self, task_id: str, op: str, *, to: str | None, actor: str, groups: Sequence[str], force: bool,
        reason: str, key: str | None, fingerprint: str,
    ) -> tuple[str, dict[str, Any] | None]: ...
    async def task_complete(
        self, task_id: str, decision: str, payload: Any, *, actor: str, groups: Sequence[str], force: bool,
        key: str | None, fingerprint: str, reviewed_version: int | None,
    ) -> tuple[str, dict[str, Any] | None, list[str]]: ...
    async def task_key_seen(self, kind: str, task_id: str, key: str, fingerprint: str) -> str | None:
        """'duplicate', 'conflict' or None: whether a task operation (kind TASK_COMPLETE or TASK_OP) was
        recorded under `key`, and with this request."""
        ...
    async def task_reassign_all(
        self, from_user: str, to_user: str, *, actor: str, reason: str, dry_run: bool,
    ) -> tuple[int, int]: ...
    async def publish_message(
        self, name: str, correlation_key: str, payload: Any, *, message_id: str | None, ttl: float | None,
        correlate_all: bool, fingerprint: str,
    ) -> dict[str, Any]: ...
    async def start_or_signal(
        self, new: Any, signal: str, payload: Any, *, dedup_key: str | None, signal_fingerprint: str,
    ) -> dict[str, Any]: ...
    async def signal_started_instance(self, instance_id: str, dedup_key: str) -> bool: ...
    async def save_task_filter(self, scope: str, owner: str, name: str, mode: str,
                               where: dict[str, Any]) -> dict[str, Any]: ...
    async def task_filters(self, scope: str, owner: str) -> list[dict[str, Any]]: ...
    async def task_filter(self, scope: str, owner: str, name: str) -> dict[str, Any] | None: ...
    async def delete_task_filter(self, scope: str, owner: str, name: str) -> bool: ...
