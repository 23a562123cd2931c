"""Running one action step's handler outside any transaction.

Async handlers run on the event loop; sync handlers in the worker's thread pool.
Whatever happens, the result is a `StepSucceeded` or `StepFailed` for the core.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor
from typing import Any

from pydantic import ValidationError

from stepstone.authoring.workflow import Signal, StepContext, Workflow
from stepstone.core.limits import Limits, PayloadRejected
from stepstone.core.model import InstanceView, RunStep, StepFailed, StepSucceeded
from stepstone.errors import StepstoneError

_MAX_MESSAGE = 1000


def idempotency_key(instance_id: str, step: str, visit: int) -> str:
    """Same on every attempt of one visit of one step, on every worker."""
    return f"{instance_id}/{step}/{visit}"


async def run_handler(
    workflow: Workflow[Any],
    instance: InstanceView,
    run: RunStep,
    *,
    signal: Any,
    executor: Executor,
    limits: Limits,
) -> StepSucceeded | StepFailed:
    """Run the step's handler and describe its outcome; never raises for handler errors."""
    try:
        state = workflow.state_from_json(instance.state)
    except ValidationError as exc:
        problem = f"stored state no longer fits the state model: {exc.error_count()} errors"
        return StepFailed("InvalidState", problem, retryable=False)
    ctx = StepContext(
        instance_id=instance.id,
        workflow=workflow.id,
        step=run.step,
        attempt=run.attempt,
        idempotency_key=idempotency_key(instance.id, run.step, run.visit),
        signal=Signal(signal["name"], signal.get("payload")) if isinstance(signal, dict) else None,
    )
    handler = workflow.handler(run.step)
    try:
        if workflow.is_async(run.step):
            result = await handler(ctx, state)
        else:
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(executor, functools.partial(handler, ctx, state))
            if asyncio.iscoroutine(result):
                result = await result
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - every handler error becomes a StepFailed
        retryable = not workflow.never_retried(run.step, exc)
        return StepFailed(type(exc).__name__, _message(exc), retryable=retryable)
    if result is not None and not isinstance(result, str):
        problem = f"handler returned {type(result).__name__}, not a step name"
        return StepFailed("InvalidTransition", problem, retryable=False)
    try:
        new_state = workflow.state_to_json(state)
        limits.encode("state", new_state)
        for event in ctx.events:
            limits.encode(f"event {event.type!r}", event.payload)
    except PayloadRejected as exc:
        return StepFailed("PayloadRejected", str(exc), retryable=False)
    except StepstoneError as exc:
        return StepFailed("InvalidState", str(exc), retryable=False)
    return StepSucceeded(result, new_state, tuple(ctx.events))


def _message(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return text[:_MAX_MESSAGE]
