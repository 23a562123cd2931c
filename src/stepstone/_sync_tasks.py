# Generated from stepstone.client.Client by `python -m stepstone._gen_sync`: do not edit by hand.
# tests/test_sync_client.py fails when this file no longer matches Client.
"""The blocking face of `TaskOperations` (`stepstone.client_tasks`), mixed into `SyncClient`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstone._sync_loop import SyncLoop

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

    from stepstone.client_tasks import BulkReassignment, TaskCompletion, TaskFilter, TaskInfo, TaskPage

__all__ = ["SyncTaskOperations"]


class SyncTaskOperations(SyncLoop):
    """`TaskOperations`'s operations as blocking calls."""

    def task(self, task_id: str) -> TaskInfo:
        """One task, any status."""
        return self._run(self._client.task(task_id))

    def tasks(
        self,
        *,
        user: str | None = None,
        groups: Sequence[str] = (),
        mode: str | None = None,
        where: TaskFilter | None = None,
        after: str | None = None,
        limit: int = 50,
        saved_filter: str | None = None,
        scope: str | None = None,
    ) -> TaskPage:
        """Open tasks (OPEN or COMPLETING) in inbox order: priority first, then oldest. `mode` (default
        inbox): inbox (the user's tasks, and unassigned ones offered to the user or their groups),
        assigned, candidate, or all (every open task; `user` and `groups` then filter by assignee and
        candidate group). `where` narrows it further. `saved_filter` names a filter `user` saved in
        `scope` (default scope unless given): its mode and its `where` (then neither may be passed)."""
        return self._run(self._client.tasks(
            user=user,
            groups=groups,
            mode=mode,
            where=where,
            after=after,
            limit=limit,
            saved_filter=saved_filter,
            scope=scope,
        ))

    def count_tasks(
        self,
        *,
        user: str | None = None,
        groups: Sequence[str] = (),
        mode: str | None = None,
        where: TaskFilter | None = None,
        saved_filter: str | None = None,
        scope: str | None = None,
    ) -> int:
        """How many open tasks `tasks` would list with the same arguments, without fetching them."""
        return self._run(self._client.count_tasks(
            user=user,
            groups=groups,
            mode=mode,
            where=where,
            saved_filter=saved_filter,
            scope=scope,
        ))

    def instance_tasks(self, instance_id: str) -> tuple[dict[str, Any], ...]:
        """Every task an instance opened, oldest first (id, position, step, visit, status, title, assignee)."""
        return self._run(self._client.instance_tasks(instance_id))

    def claim_task(
        self,
        task_id: str,
        *,
        actor: str | None = None,
        groups: Sequence[str] = (),
        admin: bool = False,
    ) -> TaskInfo:
        """Take an unassigned task as its assignee. A task someone else holds is refused (`TaskHeld`)
        unless `admin` (recorded); claiming one's own task again changes nothing."""
        return self._run(self._client.claim_task(task_id, actor=actor, groups=groups, admin=admin))

    def unclaim_task(
        self,
        task_id: str,
        *,
        actor: str | None = None,
        groups: Sequence[str] = (),
        admin: bool = False,
    ) -> TaskInfo:
        """Give a task back to its candidates (only its assignee, or an admin). Unclaiming a task nobody
        holds changes nothing, and is refused (TaskNotPermitted) to anyone who may not work on it."""
        return self._run(self._client.unclaim_task(task_id, actor=actor, groups=groups, admin=admin))

    def reassign_task(
        self,
        task_id: str,
        to: str,
        *,
        actor: str | None = None,
        reason: str = "",
        idempotency_key: str | None = None,
        admin: bool = False,
    ) -> TaskInfo:
        """Give a task to another user (its assignee, its owner or an admin may)."""
        return self._run(self._client.reassign_task(
            task_id,
            to,
            actor=actor,
            reason=reason,
            idempotency_key=idempotency_key,
            admin=admin,
        ))

    def delegate_task(
        self,
        task_id: str,
        to: str,
        *,
        actor: str | None = None,
        reason: str = "",
        idempotency_key: str | None = None,
        admin: bool = False,
    ) -> TaskInfo:
        """Delegate a task: `to` works on it and `resolve_task` gives it back to its owner (the assignee
        who delegated it, unless the task had an owner already)."""
        return self._run(self._client.delegate_task(
            task_id,
            to,
            actor=actor,
            reason=reason,
            idempotency_key=idempotency_key,
            admin=admin,
        ))

    def resolve_task(self, task_id: str, *, actor: str | None = None, admin: bool = False) -> TaskInfo:
        """The delegate hands a delegated task back to its owner."""
        return self._run(self._client.resolve_task(task_id, actor=actor, admin=admin))

    def complete_task(
        self,
        task_id: str,
        decision: str,
        payload: Any = None,
        *,
        actor: str | None = None,
        groups: Sequence[str] = (),
        idempotency_key: str | None = None,
        reviewed_version: int | None = None,
        admin: bool = False,
    ) -> TaskCompletion:
        """Complete a task with one of its decisions and that decision's payload (validated by its model).

        Refused with a typed error, nothing changed: an unknown decision (`UnknownDecision`), a payload
        failing its model (`InvalidInput`), an actor who is neither assignee, owner nor candidate
        (`TaskNotPermitted`, unless `admin`), a task not OPEN (`TaskNotOpen`, carrying the completion
        that won), a changed state where the task requires version stability (`StateChangedSinceReview`).
        The same `idempotency_key` with the same decision and payload by the same actor returns the earlier
        completion, before any check of the payload, while that completion holds the task; once it was handed
        back (refused, or dead-lettered and the task given back by a retry) the request is taken anew. With
        another request, or by another actor, `IdempotencyConflict`."""
        return self._run(self._client.complete_task(
            task_id,
            decision,
            payload,
            actor=actor,
            groups=groups,
            idempotency_key=idempotency_key,
            reviewed_version=reviewed_version,
            admin=admin,
        ))

    def reassign_all_tasks(
        self,
        from_user: str,
        to_user: str,
        *,
        actor: str | None = None,
        reason: str = "",
        dry_run: bool = False,
    ) -> BulkReassignment:
        """Move every open task of `from_user` to `to_user` (an absent colleague's), each with a history
        entry; tasks being completed are skipped and counted. `dry_run` counts and changes nothing. Moving
        them to `from_user` itself is refused (`InvalidInput`): it would record a move that changed nothing."""
        return self._run(self._client.reassign_all_tasks(
            from_user,
            to_user,
            actor=actor,
            reason=reason,
            dry_run=dry_run,
        ))
