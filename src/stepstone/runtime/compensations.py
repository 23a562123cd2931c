"""Running one compensation handler outside any transaction (`core.saga`).

Like a step's handler: async on the loop, sync in the worker's threads, and whatever it raises
(or leaves that cannot be stored) becomes a `StepFailed` the core retries under the
compensation's own policy. It gets the state as it is now and what the step recorded.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from stepstone.authoring.workflow import CompensationContext, Workflow
from stepstone.core.limits import Limits
from stepstone.core.model import Decision, InstanceView, StepFailed, StepSucceeded
from stepstone.core.saga import RunCompensation, exhausted_alert
from stepstone.runtime.handlers import (
    _boxed,
    _failed,
    _message,
    _Raised,
    _reraise_own_cancellation,
    left_behind,
    raised,
)


def compensation_key(instance_id: str, record: int) -> str:
    """Same on every attempt of one compensation, on every worker."""
    return f"{instance_id}/compensate/{record}"


async def run_compensation(
    workflow: Workflow[Any], instance: InstanceView, run: RunCompensation, *, executor: Executor, limits: Limits,
) -> StepSucceeded | StepFailed:
    """Run the compensation of `run.step`; never raises for handler errors."""
    handler = workflow.compensation_handler(run.step)
    if handler is None:
        return _failed("UnknownCompensation", f"this node declares no compensation for step {run.step!r}",
                       retryable=False)
    try:
        state = workflow.state_from_json(instance.state)
    except BaseException as exc:  # noqa: BLE001 - the model's own validators are user code too
        _reraise_own_cancellation(exc)
        return _failed("InvalidState", f"stored state no longer fits the state model: {_message(exc)}",
                       retryable=False)
    ctx = CompensationContext(
        instance_id=instance.id, workflow=workflow.id, step=run.step, position=run.position, attempt=run.attempt,
        idempotency_key=compensation_key(instance.id, run.record), cause=run.cause,
    )
    try:
        await _call(handler, ctx, state, run.recorded, executor)
    except BaseException as exc:  # noqa: BLE001 - every handler error becomes a StepFailed
        _reraise_own_cancellation(exc)
        # As a step's failure: its frames from the compensation handler down, none of this module's above it.
        return raised(exc, retryable=not workflow.compensation_never_retried(run.step, exc), engine=(__file__,))
    return left_behind(workflow, f"the compensation of {run.step!r}", None, state, ctx.events, limits)


async def _call(handler: Any, ctx: CompensationContext, state: Any, recorded: Any, executor: Executor) -> None:
    if inspect.iscoroutinefunction(handler):
        await handler(ctx, state, recorded)
        return
    loop = asyncio.get_running_loop()
    bound = functools.partial(_with_recorded, handler, recorded)
    outcome = await loop.run_in_executor(executor, functools.partial(_boxed, bound, ctx, state))
    if isinstance(outcome, _Raised):
        raise outcome.error
    if asyncio.iscoroutine(outcome):
        await outcome


def _with_recorded(handler: Any, recorded: Any, ctx: CompensationContext, state: Any) -> Any:
    return handler(ctx, state, recorded)


async def raise_alert(hook: Callable[[dict[str, Any]], Any] | None, decision: Decision) -> None:
    """The commit gave a compensation up: raise the alert hook (once: only one commit wins)."""
    alert = None if hook is None else exhausted_alert(decision)
    if alert is None or hook is None:
        return
    try:
        result = hook(alert)
        if asyncio.iscoroutine(result):
            await result
    except Exception:  # an alert hook that fails must not take the segment down; the outbox event stays
        logging.getLogger("stepstone.worker").exception(
            "the compensation_failed alert hook raised for instance %s", alert.get("instance_id"))
