# Generated from stepstone.client.Client by `python -m stepstone._gen_sync`: do not edit by hand.
# tests/test_sync_client.py fails when this file no longer matches Client.
"""The blocking face of `TaskFilterOperations` (`stepstone.client_task_filters`), mixed into `SyncClient`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstone._sync_loop import SyncLoop

if TYPE_CHECKING:
    from stepstone.client_tasks import SavedTaskFilter, TaskFilter

__all__ = ["SyncTaskFilterOperations"]


class SyncTaskFilterOperations(SyncLoop):
    """`TaskFilterOperations`'s operations as blocking calls."""

    def save_task_filter(
        self,
        name: str,
        *,
        user: str,
        mode: str = "inbox",
        where: TaskFilter | None = None,
        scope: str = "default",
    ) -> SavedTaskFilter:
        """Save (or replace) the user's inbox filter `name` in `scope`. `where.scope`, when given, must be
        `scope`: a filter only ever shows its own scope's tasks."""
        return self._run(self._client.save_task_filter(name, user=user, mode=mode, where=where, scope=scope))

    def task_filters(self, *, user: str, scope: str = "default") -> tuple[SavedTaskFilter, ...]:
        """The user's saved filters in `scope`, by name."""
        return self._run(self._client.task_filters(user=user, scope=scope))

    def task_filter(self, name: str, *, user: str, scope: str = "default") -> SavedTaskFilter:
        """One saved filter; `TaskFilterNotFound` when the user has none of that name in `scope`."""
        return self._run(self._client.task_filter(name, user=user, scope=scope))

    def delete_task_filter(self, name: str, *, user: str, scope: str = "default") -> bool:
        """Delete a saved filter; False when there was none of that name."""
        return self._run(self._client.delete_task_filter(name, user=user, scope=scope))
