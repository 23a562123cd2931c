# Generated from stepstone.client.Client by `python -m stepstone._gen_sync`: do not edit by hand.
# tests/test_sync_client.py fails when this file no longer matches Client.
"""The blocking face of `Client`: the same methods, run on a private event loop thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from stepstone.client import Client

if TYPE_CHECKING:
    from collections.abc import Sequence
    from datetime import datetime

    from stepstone.authoring.workflow import Registry, Workflow
    from stepstone.client import InstanceInfo
    from stepstone.client_messages import Published, SignalledOrStarted
    from stepstone.client_tasks import BulkReassignment, TaskCompletion, TaskFilter, TaskInfo, TaskPage
    from stepstone.config import Settings
    from stepstone.core.limits import Limits

__all__ = ["SyncClient"]

T = TypeVar("T")


class SyncClient:
    """`Client`'s operations as blocking calls; open it like `Client.connect`, close it (or use `with`)."""

    def __init__(
        self,
        database_url: str | None = None,
        *,
        schema: str | None = None,
        registry: Registry | None = None,
        settings: Settings | None = None,
        limits: Limits | None = None,
        actor: str | None = None,
    ) -> None:
        """Connect to `database_url`, or to the configured (flags, environment, pyproject.toml) or
        embedded database. The schema must be migrated (`SchemaNotReady` otherwise), except on the
        embedded default, which is migrated here, saying so in one line on the log."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="stepstone-client", daemon=True)
        self._thread.start()
        try:
            self._client: Client = self._run(Client.connect(
                database_url,
                schema=schema,
                registry=registry,
                settings=settings,
                limits=limits,
                actor=actor,
            ))
        except BaseException:
            self._stop_loop()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    @property
    def client(self) -> Client:
        """The async `Client` underneath (its coroutines run on this object's loop thread only)."""
        return self._client

    def close(self) -> None:
        """Close the connection pool and stop the loop thread."""
        try:
            self._run(self._client.close())
        finally:
            self._stop_loop()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def detach(self, ) -> None:
        """Close what this client opened beside its store (the listener `wait_for` uses), leaving the
        store open: for a client made on a store its caller owns and closes."""
        self._run(self._client.detach())

    def start(
        self,
        workflow: Workflow[Any] | str,
        input: Any = None,  # noqa: A002 - the same name as Client's parameter
        *,
        idempotency_key: str | None = None,
        business_key: str | None = None,
    ) -> str:
        """Start an instance; returns its id. The same key with the same input returns the
        same instance; the same key with other input raises IdempotencyConflict."""
        return self._run(self._client.start(
            workflow,
            input,
            idempotency_key=idempotency_key,
            business_key=business_key,
        ))

    def signal(
        self,
        instance_id: str,
        name: str,
        payload: Any = None,
        *,
        dedup_key: str | None = None,
        position: str = "",
    ) -> int:
        """Send a signal; returns its command id. A repeated dedup key applies once. `position` addresses
        one branch (its path, e.g. ``ship/2``); the default is the instance's root position."""
        return self._run(self._client.signal(instance_id, name, payload, dedup_key=dedup_key, position=position))

    def cancel(self, instance_id: str, reason: str = "") -> str:
        """Cancel an instance (idempotent); returns its status afterwards."""
        return self._run(self._client.cancel(instance_id, reason))

    def retry(self, instance_id: str) -> None:
        """Re-drive the failed step of a FAILED instance."""
        self._run(self._client.retry(instance_id))

    def get(self, instance_id: str) -> InstanceInfo:
        """Where the instance is, what it holds and what it waits for."""
        return self._run(self._client.get(instance_id))

    def history(self, instance_id: str) -> list[dict[str, Any]]:
        """Every recorded event of the instance, oldest first."""
        return self._run(self._client.history(instance_id))

    def list(
        self,
        *,
        status: str | None = None,
        definition: str | None = None,
        business_key: str | None = None,
        after: tuple[datetime, str] | None = None,
        limit: int = 50,
    ) -> list[dict[str, Any]]:
        """Instances newest first; pass the last row's (created_at, id) as `after` for the next page."""
        return self._run(self._client.list(
            status=status,
            definition=definition,
            business_key=business_key,
            after=after,
            limit=limit,
        ))

    def wait_for(self, instance_id: str, timeout: float = 30.0) -> InstanceInfo:
        """Wait until the instance completes, fails or is cancelled; WaitTimeout otherwise.

        Wakes on the notification the instance sends when it settles (one LISTEN connection per
        client, shared by every wait), with a slow re-read in case a notification is lost."""
        return self._run(self._client.wait_for(instance_id, timeout))

    def task(self, task_id: str) -> TaskInfo:
        """One task, any status."""
        return self._run(self._client.task(task_id))

    def tasks(
        self,
        *,
        user: str | None = None,
        groups: Sequence[str] = (),
        mode: str = "inbox",
        where: TaskFilter | None = None,
        after: str | None = None,
        limit: int = 50,
    ) -> TaskPage:
        """Open tasks (OPEN or COMPLETING) in inbox order: priority first, then oldest. `mode`: inbox (the
        user's tasks, and unassigned ones offered to the user or their groups), assigned, candidate, or
        all (every open task; `user` and `groups` then filter by assignee and candidate group). `where`
        narrows it further."""
        return self._run(self._client.tasks(user=user, groups=groups, mode=mode, where=where, after=after, limit=limit))

    def count_tasks(
        self,
        *,
        user: str | None = None,
        groups: Sequence[str] = (),
        mode: str = "inbox",
        where: TaskFilter | None = None,
    ) -> int:
        """How many open tasks `tasks` would list with the same arguments, without fetching them."""
        return self._run(self._client.count_tasks(user=user, groups=groups, mode=mode, where=where))

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

    def unclaim_task(self, task_id: str, *, actor: str | None = None, admin: bool = False) -> TaskInfo:
        """Give a task back to its candidates (only its assignee, or an admin)."""
        return self._run(self._client.unclaim_task(task_id, actor=actor, admin=admin))

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
        The same `idempotency_key` with the same decision and payload returns the earlier completion;
        with another, `IdempotencyConflict`."""
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
        entry; tasks being completed are skipped and counted. `dry_run` counts and changes nothing."""
        return self._run(self._client.reassign_all_tasks(
            from_user,
            to_user,
            actor=actor,
            reason=reason,
            dry_run=dry_run,
        ))

    def publish_message(
        self,
        name: str,
        correlation_key: str,
        payload: Any = None,
        *,
        message_id: str | None = None,
        ttl: float | None = None,
        correlate_all: bool = False,
    ) -> Published:
        """Deliver a message to the oldest open subscription of (`name`, `correlation_key`), or to every
        one with `correlate_all`; buffer it for `ttl` seconds when none is open, else drop it. The same
        `message_id` with the same content answers as before; with other content, IdempotencyConflict."""
        return self._run(self._client.publish_message(
            name,
            correlation_key,
            payload,
            message_id=message_id,
            ttl=ttl,
            correlate_all=correlate_all,
        ))

    def start_or_signal(
        self,
        workflow: Workflow[Any] | str,
        business_key: str,
        signal: str,
        payload: Any = None,
        *,
        input: Any = None,  # noqa: A002 - the same name as Client's parameter
        dedup_key: str | None = None,
    ) -> SignalledOrStarted:
        """Signal the instance of `workflow` with `business_key`, starting it with `input` first when
        none has the key, in one transaction: two concurrent calls start one instance and both signal it.
        A signal sent before the instance reaches a wait that takes it waits (parked) until it does."""
        return self._run(self._client.start_or_signal(
            workflow,
            business_key,
            signal,
            payload,
            input=input,
            dedup_key=dedup_key,
        ))
