"""A Python external-task worker: handlers per topic, locks kept while they run, answers sent for them.

    worker = ExternalWorker(tasks, "billing-1")

    @worker.subscribe("payments")
    async def charge(task: LockedTask) -> dict[str, Any]:
        if declined(task.payload):
            raise BusinessError("card_declined", "insufficient funds")
        return {"charge_id": await gateway.charge(task.id, task.payload["amount"])}   # keyed on task.id

    await worker.run(stop)          # until `stop` is set; or `await worker.run_once()` for one round

What a handler returns (a dict or None) completes the task with those variables; `BusinessError`
answers a business error; any other exception reports a failure (retried per the step's policy). The
lock is extended every third of its duration while the handler runs; a handler whose lock was refused
(it ran past an expiry another worker took over, or its instance was cancelled) has its answer
dropped, never sent on a stale token, and the log says which refusal it was.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from stepstone._waiting import cancel_and_wait, wait_set
from stepstone.errors import InvalidInput, StepstoneError, TaskLockRefused
from stepstone.external.tasks import ExternalTasks, LockedTask
from stepstone.runtime.handlers import describe_error

__all__ = ["BusinessError", "ExternalWorker"]

log = logging.getLogger("stepstone.external.worker")

TaskHandler = Callable[[LockedTask], "Awaitable[dict[str, Any] | None] | dict[str, Any] | None"]


class BusinessError(Exception):
    """Raise from a handler to answer a business error: the step's `errors[code]` is taken."""

    def __init__(self, code: str, message: str = "", *, variables: dict[str, Any] | None = None,
                 details: Any = None) -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message
        self.variables = variables
        self.details = details


class ExternalWorker:
    """Runs the handlers of its topics on the tasks it fetches, at most `max_tasks` at a time."""

    def __init__(self, tasks: ExternalTasks, worker_id: str, *, lock_duration: float = 30.0, max_tasks: int = 10,
                 long_poll: float = 20.0) -> None:
        self.tasks = tasks
        self.worker_id = worker_id
        self.lock_duration = lock_duration
        self.max_tasks = max_tasks
        self.long_poll = long_poll
        self.handlers: dict[str, TaskHandler] = {}
        self.answered = 0
        self.dropped = 0

    def subscribe(self, topic: str) -> Callable[[TaskHandler], TaskHandler]:
        def register(handler: TaskHandler) -> TaskHandler:
            self.handlers[topic] = handler
            return handler

        return register

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch (long polling) and handle until `stop` is set; the round in hand is finished."""
        while not stop.is_set():
            try:
                await self.run_once(timeout=self.long_poll, stop=stop)
            except StepstoneError as exc:  # the database is away: try again shortly
                log.warning("external worker %s: %s; retrying in 1 s", self.worker_id, exc)
                await wait_set(stop, 1.0)

    async def run_once(self, *, timeout: float = 0.0, stop: asyncio.Event | None = None) -> int:
        """One fetch and the handling of what it locked; returns how many tasks were answered."""
        if not self.handlers:
            raise ValueError("subscribe a handler to at least one topic first")
        fetch = asyncio.ensure_future(self.tasks.fetch_and_lock(
            self.worker_id, list(self.handlers), max_tasks=self.max_tasks, lock_duration=self.lock_duration,
            timeout=timeout))
        if stop is not None:
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait({fetch, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not fetch.done():
                await cancel_and_wait(fetch)  # a cancellation of run_once meanwhile goes through
                return 0
        locked = await fetch
        before = self.answered
        # Every handler of the round runs to its answer before the round ends: an answer that failed (the
        # database away) is raised once all have, never leaving the others running unawaited.
        outcomes = await asyncio.gather(*(self._handle(task) for task in locked), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return self.answered - before

    async def _handle(self, task: LockedTask) -> None:
        keeper = asyncio.create_task(self._keep(task))
        try:
            outcome: Any = await self._call(task)
        except BusinessError as exc:
            outcome = exc
        except Exception as exc:  # noqa: BLE001 - every handler error is reported as the task's failure
            outcome = exc
        finally:
            refused = await cancel_and_wait(keeper)  # a cancellation of _handle meanwhile goes through
        if refused is not None:
            self.dropped += 1
            log.warning("external task %s: its lock was refused while its handler ran (%s: %s); its answer is "
                        "dropped", task.id, refused.reason, refused)
            return
        try:
            try:
                await self._answer(task, outcome)
            except InvalidInput as exc:  # what the handler returned cannot be stored: a failure instead
                await self._answer(task, ValueError(f"the handler's result was refused: {exc}"))
        except TaskLockRefused as exc:
            self.dropped += 1
            log.warning("external task %s: answer refused (%s)", task.id, exc.reason)
            return
        self.answered += 1

    async def _call(self, task: LockedTask) -> Any:
        handler = self.handlers[task.topic]
        if inspect.iscoroutinefunction(handler):
            return await handler(task)
        result = await asyncio.to_thread(handler, task)
        return await result if inspect.isawaitable(result) else result

    async def _answer(self, task: LockedTask, outcome: Any) -> None:
        if isinstance(outcome, BusinessError):
            await self.tasks.raise_error(task.id, task.lock_token, outcome.code, outcome.message,
                                         variables=outcome.variables, details=outcome.details,
                                         worker_id=self.worker_id)
        elif isinstance(outcome, Exception):
            await self.tasks.fail(task.id, task.lock_token, describe_error(outcome), worker_id=self.worker_id)
        else:
            await self.tasks.complete(task.id, task.lock_token, outcome, worker_id=self.worker_id)

    async def _keep(self, task: LockedTask) -> TaskLockRefused:
        """Extend the lock every third of its duration while the handler runs; the refusal that ends it
        (another worker took the task, or nobody waits for it any more: the instance was cancelled)."""
        while True:
            await asyncio.sleep(self.lock_duration / 3)
            try:
                await self.tasks.extend_lock(task.id, task.lock_token, self.lock_duration)
            except TaskLockRefused as refused:
                return refused
            except StepstoneError as exc:  # transient: the next round tries again before the lock runs out
                log.warning("external task %s: cannot extend its lock now (%s)", task.id, exc)
