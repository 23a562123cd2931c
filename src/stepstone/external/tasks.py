"""External tasks for outside workers: fetch and lock by topic, extend, complete, fail, raise a business error.

    async with await ExternalTasks.open() as tasks:          # the configured (or embedded) database
        for task in await tasks.fetch_and_lock("worker-1", ["payments"], max_tasks=10, timeout=20):
            charge = charge_card(task.payload)                # at least once: key it on task.id
            await tasks.complete(task.id, task.lock_token, {"charge_id": charge})

Every answer is fenced on the lock token: one whose lock moved to another worker raises `LockLost`,
one that came after the lock expired `LockExpired`, one for a task already answered or no longer
awaited `TaskEnded` (all `TaskLockRefused`, a `Conflict`). Repeating an answer with the same token
(a worker retrying after a lost reply) returns the first one's result with `duplicate` set.
`stepstone external serve` offers the same operations over HTTP (`stepstone.external.http`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any

from stepstone import cursors
from stepstone._waiting import wait_set
from stepstone.config import Settings
from stepstone.core.limits import Limits, PayloadRejected
from stepstone.core.plan import valid_name
from stepstone.errors import (
    ExternalTaskNotFound,
    InvalidInput,
    LockExpired,
    LockLost,
    StepstoneError,
    TaskEnded,
    TaskLockRefused,
    refused,
)
from stepstone.store.external import Answer, LockedTask, PostgresExternalTasks
from stepstone.store.factory import open_ready_store
from stepstone.store.port import Listener, Store

__all__ = ["STATUSES", "ExternalTasks", "LockedTask", "TaskAnswer", "TaskPage"]

STATUSES = ("OPEN", "COMPLETED", "ERROR", "FAILED", "CANCELLED")
"""The statuses of an external task, for the filters of its lists."""

log = logging.getLogger("stepstone.external")

MAX_TASKS = 1000
MAX_LOCK_SECONDS = 24 * 3600.0
MAX_TIMEOUT_SECONDS = 300.0


@dataclass(frozen=True)
class TaskPage:
    """A page of `ExternalTasks.page`: its tasks, and the cursor of the next page (None on the last)."""

    tasks: list[dict[str, Any]]
    next_cursor: str | None


@dataclass(frozen=True)
class TaskAnswer:
    """An answer the store accepted. `status` is the task's: COMPLETED, ERROR, FAILED (an incident
    on the instance), or OPEN when a failure is retried at `available_at` with `retries` left."""

    task_id: str
    status: str
    command_id: int | None = None
    duplicate: bool = False
    available_at: datetime | None = None
    retries: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["available_at"] = self.available_at.isoformat() if self.available_at else None
        return out


class ExternalTasks:
    """The external-task operations on a store; the Python client and the HTTP app both use them."""

    def __init__(self, store: Store, *, limits: Limits | None = None, poll_interval: float = 1.0,
                 owns_store: bool = False) -> None:
        self.store = store
        self.db = PostgresExternalTasks(store)
        self.limits = limits or Limits()
        self.poll_interval = poll_interval
        self._owns_store = owns_store
        self._listener: Listener | None = None
        self._listening: asyncio.Lock | None = None
        self._woken = asyncio.Event()

    @classmethod
    async def open(cls, database_url: str | None = None, schema: str | None = None, *,
                   settings: Settings | None = None, poll_interval: float = 1.0) -> ExternalTasks:
        """On the database given, or the configured one (flags, environment, pyproject.toml), or the
        embedded default; the schema must be migrated (the embedded one is migrated here)."""
        store = await open_ready_store(database_url, schema, settings=settings, max_size=5)
        return cls(store, poll_interval=poll_interval, owns_store=True)

    async def close(self) -> None:
        if self._listener is not None:
            await self._listener.close()
            self._listener = None
        if self._owns_store:
            await self.store.close()

    async def __aenter__(self) -> ExternalTasks:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # -- fetch and lock ---------------------------------------------------------------------------

    async def fetch_and_lock(
        self, worker_id: str, topics: Sequence[str] | str, *, max_tasks: int = 1, lock_duration: float = 30.0,
        timeout: float = 0.0,
    ) -> list[LockedTask]:
        """Lock up to `max_tasks` tasks of `topics` for `lock_duration` seconds, oldest first.

        With `timeout` > 0 this long-polls: when none is available it waits up to that many seconds
        for one (woken by the database, with a poll every `poll_interval` as the fallback)."""
        names = _topic_names(topics)
        self._check_fetch(worker_id, names, max_tasks, lock_duration, timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if timeout > 0:
            await self._listen()
        while True:
            woken = self._woken  # taken before the fetch: a task opening during it still wakes this poll
            tasks, closed = await self.db.fetch(names, max_tasks, lock_duration, worker_id)
            remaining = deadline - loop.time()
            if tasks or remaining <= 0:
                return tasks
            if closed:
                continue  # stale tasks took the slots: look again at once
            await wait_set(woken, min(remaining, self.poll_interval))

    async def _listen(self) -> None:
        if self._listener is not None and self._listener.alive:
            return
        self._listening = self._listening or asyncio.Lock()
        async with self._listening:
            if self._listener is not None and self._listener.alive:
                return
            try:
                self._listener = await self.db.listen(self._wake)
            except StepstoneError as exc:  # long polls still work, by polling
                log.warning("external tasks: cannot listen for new tasks (%s); polling every %g s",
                            exc, self.poll_interval)

    def _wake(self) -> None:
        """A task became fetchable: wake every poll waiting now (each holds the event it took)."""
        woken, self._woken = self._woken, asyncio.Event()
        woken.set()

    def _check_fetch(self, worker_id: str, topics: list[str], max_tasks: int, lock_duration: float,
                     timeout: float) -> None:
        self._text("worker_id", worker_id)
        if not topics:
            raise InvalidInput("give at least one topic", what="topics")
        for topic in topics:
            if not isinstance(topic, str) or not valid_name(topic):
                raise InvalidInput(f"invalid topic {topic!r} (letters, digits, _ . -; at most 128)", what="topics")
        _number("max_tasks", max_tasks, 1, MAX_TASKS, integer=True)
        _number("lock_duration", lock_duration, 0.001, MAX_LOCK_SECONDS)
        _number("timeout", timeout, 0, MAX_TIMEOUT_SECONDS)

    # -- answers ----------------------------------------------------------------------------------

    async def extend_lock(self, task_id: str, lock_token: str, lock_duration: float) -> datetime:
        """Hold the task `lock_duration` more seconds from now; returns the new expiry."""
        _number("lock_duration", lock_duration, 0.001, MAX_LOCK_SECONDS)
        task, token = _ids(task_id, lock_token)
        outcome, until, status = await self.db.extend(task, token, lock_duration)
        if outcome != "extended" or until is None:
            raise _refusal(task_id, outcome, status)
        return until

    async def complete(self, task_id: str, lock_token: str, variables: dict[str, Any] | None = None, *,
                       worker_id: str | None = None) -> TaskAnswer:
        """Complete the task: its `variables` (a JSON object) are merged into the instance's state
        and the instance goes on."""
        return await self._answer(task_id, lock_token, "completed", variables=self._variables(variables),
                                  worker_id=worker_id)

    async def raise_error(self, task_id: str, lock_token: str, code: str, message: str = "", *,
                          variables: dict[str, Any] | None = None, details: Any = None,
                          worker_id: str | None = None) -> TaskAnswer:
        """A business error: the step's `errors[code]` is taken (an incident when it has none)."""
        if not isinstance(code, str) or not valid_name(code):
            raise InvalidInput(f"invalid error code {code!r} (letters, digits, _ . -; at most 128)", what="code")
        error = {"code": code, "message": self._text("message", message, free=True, empty=True),
                 "details": self._json("details", details)}
        return await self._answer(task_id, lock_token, "error", variables=self._variables(variables), error=error,
                                  worker_id=worker_id)

    async def fail(self, task_id: str, lock_token: str, message: str, *, details: Any = None,
                   retries: int | None = None, retry_delay: float | None = None,
                   worker_id: str | None = None) -> TaskAnswer:
        """The worker could not do it. The task is offered again after `retry_delay` seconds (default:
        the step's backoff) while retries remain (default: one fewer than before; `retries=0` stops
        at once), then the position fails with an incident an operator can retry."""
        if retries is not None:
            _number("retries", retries, 0, 1_000_000, integer=True)
        if retry_delay is not None:
            _number("retry_delay", retry_delay, 0, MAX_LOCK_SECONDS)
        error = {"message": self._text("message", message, free=True, empty=True),
                 "details": self._json("details", details)}
        return await self._answer(task_id, lock_token, "failed", error=error, retries=retries,
                                  retry_delay=retry_delay, worker_id=worker_id)

    async def list(self, *, topic: str | None = None, status: str | None = None, instance_id: str | None = None,
                   limit: int = 50) -> list[dict[str, Any]]:
        """The first `limit` tasks oldest first, filtered by topic, status and instance."""
        return (await self.page(topic=topic, status=status, instance_id=instance_id, limit=limit)).tasks

    async def page(self, *, topic: str | None = None, status: str | None = None, instance_id: str | None = None,
                   limit: int = 50, after: str | None = None, what: str = "cursor") -> TaskPage:
        """A page of tasks oldest first, filtered by topic, status and instance, after the page whose
        `next_cursor` is `after` (InvalidInput naming `what`, the parameter that carried it, when it
        is not one)."""
        _number("limit", limit, 1, 10_000, integer=True)
        if status is not None and status.upper() not in STATUSES:
            raise InvalidInput(f"status must be one of {', '.join(STATUSES)}, got {status!r}", what="status")
        key = cursors.decode(after, cursors.INSTANT, cursors.UUID, what=what) if after else None
        instance = None
        if instance_id is not None:
            try:
                instance = uuid.UUID(str(instance_id))
            except ValueError:
                return TaskPage([], None)
        rows = await self.db.list(topic=topic, status=status.upper() if status else None, instance_id=instance,
                                  limit=limit + 1, after=key)
        found, more = rows[:limit], len(rows) > limit
        last = found[-1] if found else None
        return TaskPage(found, cursors.encode(last["created_at"].isoformat(), last["id"]) if more and last else None)

    async def _answer(self, task_id: str, lock_token: str, outcome: str, *, variables: Any = None,
                      error: Any = None, retries: int | None = None, retry_delay: float | None = None,
                      worker_id: str | None = None) -> TaskAnswer:
        if worker_id is not None:
            self._text("worker_id", worker_id)
        task, token = _ids(task_id, lock_token)
        answer: Answer = await self.db.answer(task, token, outcome, variables=variables, error=error,
                                              retries=retries, retry_delay=retry_delay, worker=worker_id)
        if answer.outcome not in ("recorded", "retrying", "duplicate"):
            raise _refusal(task_id, answer.outcome, answer.status)
        return TaskAnswer(str(task), answer.status or "", answer.command_id, answer.outcome == "duplicate",
                          answer.available_at if answer.outcome == "retrying" else None,
                          answer.retries if answer.outcome == "retrying" else None)

    # -- input checks -----------------------------------------------------------------------------

    def _variables(self, variables: Any) -> Any:
        if variables is None:
            return None
        if not isinstance(variables, dict):
            raise InvalidInput(f"variables must be a JSON object, got {type(variables).__name__}", what="variables")
        return self._json("variables", variables)

    def _json(self, what: str, value: Any) -> Any:
        try:
            self.limits.encode(what, value)
        except PayloadRejected as exc:
            raise refused(exc) from None
        return value

    def _text(self, what: str, value: Any, *, free: bool = False, empty: bool = False) -> str:
        try:
            return self.limits.check_text(what, value, free=free, empty=empty)
        except PayloadRejected as exc:
            raise refused(exc) from None


def _topic_names(topics: Any) -> list[str]:
    """One topic or a list of them; anything else (a number, an object, whose keys would pass for
    topics) is refused, not iterated."""
    if isinstance(topics, str):
        return [topics]
    if not isinstance(topics, (list, tuple, set, frozenset)):
        raise InvalidInput(f"topics must be a topic or a list of topics, got {type(topics).__name__}", what="topics")
    return list(topics)


def _number(what: str, value: Any, low: float, high: float, *, integer: bool = False) -> None:
    kinds: tuple[type[Any], ...] = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= float(value) <= high:
        kind = "an integer" if integer else "a number"
        raise InvalidInput(f"{what} must be {kind} from {low:g} to {high:g}, got {value!r}", what=what)


def _ids(task_id: str, lock_token: str) -> tuple[uuid.UUID, uuid.UUID]:
    try:
        task = uuid.UUID(str(task_id))
    except ValueError:
        raise ExternalTaskNotFound(str(task_id)) from None
    try:
        token = uuid.UUID(str(lock_token))
    except ValueError:
        raise LockLost(f"external task {task}: {lock_token!r} is not a lock token", task_id=str(task),
                       reason="lock_lost", status=None) from None
    return task, token


def _refusal(task_id: str, outcome: str, status: str | None) -> StepstoneError:
    if outcome == "not_found":
        return ExternalTaskNotFound(task_id)
    where = f"external task {task_id}"
    if outcome == "lock_lost":
        return LockLost(f"{where}: this lock token does not hold it (it was locked again, by another worker "
                        "or after a retry)", task_id=task_id, reason=outcome, status=status)
    if outcome == "lock_expired":
        return LockExpired(f"{where}: the lock expired before the answer; fetch it again", task_id=task_id,
                           reason=outcome, status=status)
    if outcome == "not_awaited" or (outcome == "not_open" and status == "CANCELLED"):
        # A task is CANCELLED only when its position no longer waits for it (migration 0049: its
        # cancellation cancels it at once), so an answer to one is told so, however it was closed.
        return TaskEnded(f"{where}: its position no longer waits for it (cancelled or moved on)", task_id=task_id,
                         reason="not_awaited", status=status)
    if outcome == "not_open":
        return TaskEnded(f"{where} is {status} already", task_id=task_id, reason=outcome, status=status)
    return TaskLockRefused(f"{where}: refused ({outcome})", task_id=task_id, reason=outcome, status=status)
