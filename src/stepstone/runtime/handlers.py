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

from stepstone.authoring.workflow import BranchInfo, ChildResult, Registry, Signal, StepContext, Workflow
from stepstone.core.limits import Limits, PayloadRejected
from stepstone.core.model import ROOT, ChildStart, InstanceView, RunStep, StepFailed, StepSucceeded
from stepstone.errors import StepstoneError

_MAX_MESSAGE = 1000


def idempotency_key(instance_id: str, step: str, visit: int, position: str = ROOT) -> str:
    """Same on every attempt of one visit of one step of one position, on every worker."""
    if position == ROOT:
        return f"{instance_id}/{step}/{visit}"
    return f"{instance_id}/{position}/{step}/{visit}"


async def run_handler(  # noqa: PLR0911 - each guarded outcome returns at once
    workflow: Workflow[Any],
    instance: InstanceView,
    run: RunStep,
    *,
    cause: dict[str, Any] | None,
    executor: Executor,
    limits: Limits,
    registry: Registry | None = None,
) -> StepSucceeded | StepFailed:
    """Run the step's handler and describe its outcome; never raises for handler errors.
    `cause` is what led to this step (a signal, a child's end), shown to the handler."""
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
        idempotency_key=idempotency_key(instance.id, run.step, run.visit, instance.position),
        signal=_signal(cause),
        child=_child(cause),
        branch=_branch(instance),
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
    child: ChildStart | None = None
    if workflow.plan.steps[run.step].kind == "child":
        child, failed = _child_start(workflow, run.step, result, registry)
        if failed is not None:
            return failed
        result = None
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
    return StepSucceeded(result, new_state, tuple(ctx.events), child=child)


def _child_start(
    workflow: Workflow[Any], step: str, value: Any, registry: Registry | None
) -> tuple[ChildStart | None, StepFailed | None]:
    """The child a child step's handler asked for: its latest registered version and its input."""
    name = workflow.plan.steps[step].workflow or ""
    child_wf = registry.latest(name) if registry is not None else None
    if child_wf is None:
        problem = f"child step {step!r}: workflow {name!r} is not registered on this worker"
        return None, StepFailed("UnknownWorkflow", problem, retryable=False)
    try:
        state = child_wf.state_to_json({} if value is None else value)
    except StepstoneError as exc:
        return None, StepFailed("InvalidInput", f"child step {step!r}: {exc}", retryable=False)
    plan = child_wf.plan
    return ChildStart(plan.definition_id, plan.version, plan.plan_hash, plan.start, state), None


def _signal(cause: dict[str, Any] | None) -> Signal | None:
    signal = cause.get("signal") if cause else None
    return Signal(signal["name"], signal.get("payload")) if isinstance(signal, dict) else None


def _child(cause: dict[str, Any] | None) -> ChildResult | None:
    child = cause.get("child") if cause else None
    if not isinstance(child, dict):
        return None
    return ChildResult(str(child.get("child_id")), str(child.get("status")), child.get("state"), child.get("error"))


def _branch(instance: InstanceView) -> BranchInfo | None:
    b = instance.branch
    return None if b is None else BranchInfo(b.name, instance.position, b.item)


def _message(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return text[:_MAX_MESSAGE]
