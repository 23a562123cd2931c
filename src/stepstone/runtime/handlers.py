"""Running one action step's handler outside any transaction.

Async handlers run on the event loop; sync handlers in the worker's thread pool.
Whatever happens, the result is a `StepSucceeded` or `StepFailed` for the core:
any exception of the handler (`SystemExit`, `KeyboardInterrupt` and the other
`BaseException`s included) is a step failure; only the cancellation of the
segment itself (the worker draining) goes through. What the handler leaves (its
state, its events, its error text) is checked here against the limits, so a step
that cannot be stored fails cleanly instead of crashing its commit.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import traceback
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from stepstone.authoring.selection import SelectsVersions, selected_workflow
from stepstone.authoring.workflow import (
    BranchInfo,
    ChildResult,
    ExternalResult,
    Registry,
    Signal,
    StepContext,
    TaskOutcome,
    Workflow,
)
from stepstone.core.failures import MAX_CAUSES, MAX_FRAMES, MAX_FRAMES_BYTES, Frame, bounded, frames_bytes
from stepstone.core.limits import Limits, PayloadRejected
from stepstone.core.model import ROOT, ChildStart, Event, InstanceView, RunStep, StepFailed, StepSucceeded
from stepstone.core.transitions import child_id
from stepstone.errors import DefinitionNotFound, StepstoneError
from stepstone.runtime.outage import until_reachable

_MAX_MESSAGE = 1000


def idempotency_key(instance_id: str, step: str, visit: int, position: str = ROOT) -> str:
    """Same on every attempt of one visit of one step of one position, on every worker."""
    if position == ROOT:
        return f"{instance_id}/{step}/{visit}"
    return f"{instance_id}/{position}/{step}/{visit}"


async def run_handler(
    workflow: Workflow[Any],
    instance: InstanceView,
    run: RunStep,
    *,
    cause: dict[str, Any] | None,
    executor: Executor,
    limits: Limits,
    children: ChildVersions | None = None,
) -> StepSucceeded | StepFailed:
    """Run the step's handler and describe its outcome; never raises for handler errors.
    `cause` is what led to this step (a signal, a child's end), shown to the handler; `children` is
    where a child step finds the version of its child, and keeps the run that started one: when its
    commit is refused because the child's version was deprecated since, the step's next run on the same
    state selects the version again instead of running the handler a second time."""
    key = (run.step, run.visit, instance.state_version)
    again = children.ran.pop(key, None) if children is not None else None
    outcome: StepSucceeded | StepFailed
    if again is not None and children is not None:
        ran, asked = again
        named = child_id(instance.id, instance.position, run.step, run.visit)
        child, failed = await _child_start(workflow, run.step, asked, children, named)
        outcome = failed or replace(ran, child=child)
    else:
        outcome, asked = await _run(workflow, instance, run, cause, executor, limits, children)
    if children is not None and isinstance(outcome, StepSucceeded) and outcome.child is not None:
        children.ran[key] = (outcome, asked)
    return outcome


async def _run(
    workflow: Workflow[Any], instance: InstanceView, run: RunStep, cause: dict[str, Any] | None, executor: Executor,
    limits: Limits, children: ChildVersions | None,
) -> tuple[StepSucceeded | StepFailed, Any]:
    """The handler's outcome, and what it returned as its child's input (a child step that started one)."""
    asked: Any = None
    try:
        state = workflow.state_from_json(instance.state)
    except BaseException as exc:  # noqa: BLE001 - the model's own validators are user code too
        _reraise_own_cancellation(exc)
        problem = f"stored state no longer fits the state model: {describe_error(exc)}"
        return _failed("InvalidState", problem, retryable=False), None
    ctx = StepContext(
        instance_id=instance.id,
        workflow=workflow.id,
        step=run.step,
        attempt=run.attempt,
        idempotency_key=idempotency_key(instance.id, run.step, run.visit, instance.position),
        signal=_signal(cause),
        child=_child(cause),
        branch=_branch(instance),
        external=_external(cause),
        task=_task(cause),
    )
    try:
        result = await _call(workflow, run.step, ctx, state, executor)
    except BaseException as exc:  # noqa: BLE001 - every handler error becomes a StepFailed
        _reraise_own_cancellation(exc)
        return raised(exc, retryable=not workflow.never_retried(run.step, exc)), None
    child: ChildStart | None = None
    if workflow.plan.steps[run.step].kind == "child":
        named = child_id(instance.id, instance.position, run.step, run.visit)
        child, failed = await _child_start(workflow, run.step, result, children, named)
        if failed is not None:
            return failed, None
        asked, result = result, None
    if result is not None and not isinstance(result, str):
        problem = f"handler returned {type(result).__name__}, not a step name"
        return _failed("InvalidTransition", problem, retryable=False), None
    if result is not None and len(result) > limits.max_name_length:
        problem = f"handler returned a step name of {len(result)} characters; no step has one that long"
        return _failed("InvalidTransition", problem, retryable=False), None
    return _with_record(left_behind(workflow, f"step {run.step!r}", result, state, ctx.events, limits, child), ctx,
                        limits), asked


def _with_record(left: StepSucceeded | StepFailed, ctx: StepContext, limits: Limits) -> StepSucceeded | StepFailed:
    """What the step kept for its compensation (`ctx.record`), checked as the commit will store it."""
    if ctx.recorded is None or not isinstance(left, StepSucceeded):
        return left
    try:
        limits.encode(f"record of step {ctx.step!r}", ctx.recorded)
    except PayloadRejected as exc:
        return _failed("PayloadRejected", str(exc), retryable=False)
    return replace(left, recorded=ctx.recorded)


def left_behind(
    workflow: Workflow[Any], what: str, result: str | None, state: Any, events: list[Event], limits: Limits,
    child: ChildStart | None = None,
) -> StepSucceeded | StepFailed:
    """What a handler (`what`: "step 'x'", or "the compensation of 'x'") left, as the commit will store it, or
    why it cannot be stored: the state model's own validators and serializers are user code and may raise
    anything, which fails this attempt instead of crashing the worker's segment."""
    try:
        new_state, text = workflow.state_document(state, what=f"state left by {what}")
        size = len(limits.encode("state", new_state, text).encode()) + check_events(limits, events)
        limits.check_commit(what, size)
    except PayloadRejected as exc:
        return _failed("PayloadRejected", str(exc), retryable=False)
    except StepstoneError as exc:
        return _failed("InvalidState", str(exc), retryable=False)
    except BaseException as exc:  # noqa: BLE001 - a validator or serializer of the model raised
        _reraise_own_cancellation(exc)
        return _failed("InvalidState", f"state left by {what} cannot be stored: {describe_error(exc)}",
                       retryable=False)
    return StepSucceeded(result, new_state, tuple(events), child=child)


@dataclass(frozen=True)
class ChildVersions:
    """Where a child step finds its child's version: the one a `Client.start` of that workflow in the
    parent's scope runs (`selected_workflow`), as this worker's registry holds it."""

    store: HasDefinitions
    registry: Registry
    scope: str
    retried: bool = False
    """The step runs again under an operator's retry, at the visit that may have started its child already."""
    ran: dict[tuple[str, int, int], tuple[StepSucceeded, Any]] = field(default_factory=dict, compare=False)
    """By (step, visit, state version): the outcome of the run that started a child and what its handler
    returned as the child's input, should that commit be refused and the child's version be selected again."""


class _ChildDefinitions(SelectsVersions, Protocol):
    async def child_pin(self, child_id: str, definition_id: str) -> tuple[int, str] | None: ...


class HasDefinitions(Protocol):
    @property
    def definitions(self) -> _ChildDefinitions: ...


async def _child_start(
    workflow: Workflow[Any], step: str, value: Any, children: ChildVersions | None, named: str
) -> tuple[ChildStart | None, StepFailed | None]:
    """The child a child step's handler asked for: the version a start in the parent's scope runs, and its
    input. A version that cannot take the child is the step's failure, never a crash of its commit. A step
    an operator's retry runs again names the child its visit started, if it did: that child's version (its
    input is not used again: the child is not started twice)."""
    name = workflow.plan.steps[step].workflow or ""
    child_wf = None if children is None else children.registry.latest(name)
    if children is None or child_wf is None:
        problem = f"child step {step!r}: workflow {name!r} is not registered on this worker"
        return None, _failed("UnknownWorkflow", problem, retryable=False)
    pins = children.store.definitions
    existing = await until_reachable(lambda: pins.child_pin(named, name)) if children.retried else None
    try:
        child_wf = (children.registry.find(name, *existing) or child_wf) if existing is not None else (
            await until_reachable(lambda: selected_workflow(pins, children.registry, name, children.scope,
                                                            holder="this worker's registry")))
    except DefinitionNotFound as exc:  # a rolling deploy: a worker that has the selected version may retry it
        return None, _failed("DefinitionNotFound", f"child step {step!r}: {exc}; deploy it to every worker "
                             f"that runs {workflow.id!r}", retryable=True)
    if child_wf is None:  # what a start of it in this scope would be refused (VersionNotAdmitted)
        problem = (f"child step {step!r}: no version of workflow {name!r} takes new instances in scope "
                   f"{children.scope}: none is activated or AVAILABLE there or in the default scope; make one "
                   f"AVAILABLE (`stepstone definitions reinstate {name} VERSION`) or deploy a new version, "
                   f"then retry this instance")
        return None, _failed("VersionNotAdmitted", problem, retryable=False)
    try:
        state = child_wf.state_to_json({} if value is None else value, what=f"input of child step {step!r}")
    except StepstoneError as exc:
        return None, _failed("InvalidInput", f"child step {step!r}: {exc}", retryable=False)
    plan = child_wf.plan
    version, plan_hash = existing or (plan.version, plan.plan_hash)
    return ChildStart(plan.definition_id, version, plan_hash, plan.start, state,
                      deadline_seconds=child_wf.deadline, start_deadline_seconds=plan.start_deadline), None



def _signal(cause: dict[str, Any] | None) -> Signal | None:
    signal = cause.get("signal") if cause else None
    return Signal(signal["name"], signal.get("payload")) if isinstance(signal, dict) else None


def _task(cause: dict[str, Any] | None) -> TaskOutcome | None:
    task = cause.get("task") if cause else None
    if not isinstance(task, dict):
        return None
    return TaskOutcome(str(task.get("id")), str(task.get("decision")), task.get("payload"), task.get("actor"))


def _child(cause: dict[str, Any] | None) -> ChildResult | None:
    child = cause.get("child") if cause else None
    if not isinstance(child, dict):
        return None
    return ChildResult(str(child.get("child_id")), str(child.get("status")), child.get("state"), child.get("error"))


def _external(cause: dict[str, Any] | None) -> ExternalResult | None:
    answer = cause.get("external") if cause else None
    if not isinstance(answer, dict):
        return None
    return ExternalResult(str(answer.get("task_id")), str(answer.get("outcome")), answer.get("error"))


def _branch(instance: InstanceView) -> BranchInfo | None:
    b = instance.branch
    return None if b is None else BranchInfo(b.name, instance.position, b.item)


async def _call(workflow: Workflow[Any], step: str, ctx: StepContext, state: Any, executor: Executor) -> Any:
    handler = workflow.handler(step)
    if workflow.is_async(step):
        return await handler(ctx, state)
    loop = asyncio.get_running_loop()
    # In the caller's context copy: the durable context and the current span reach sync handlers too.
    run = functools.partial(contextvars.copy_context().run, _boxed, handler, ctx, state)
    outcome = await loop.run_in_executor(executor, run)
    if isinstance(outcome, _Raised):
        raise outcome.error
    if asyncio.iscoroutine(outcome):
        return await outcome
    return outcome


@dataclass(frozen=True)
class _Raised:
    error: BaseException


def _boxed(handler: Callable[..., Any], ctx: Any, state: Any) -> Any:
    """Run a sync handler in its thread; what it raises comes back as a value. A GeneratorExit
    set on the future would otherwise be thrown into the awaiting coroutine and close it."""
    try:
        return handler(ctx, state)
    except BaseException as exc:  # noqa: BLE001 - handed back to run_handler
        return _Raised(exc)


def check_events(limits: Limits, events: list[Event]) -> int:
    """Check the events a step emitted as the commit will store them; their size in bytes."""
    if len(events) > limits.max_events_per_step:
        raise PayloadRejected(
            "events", "too_large", f"{len(events)} events exceed the limit of {limits.max_events_per_step} per step"
        )
    size = 0
    for n, event in enumerate(events):
        where = f"event {n}"
        for part, value in (("type", event.type), ("key", event.key)):
            if value is None and part == "key":
                continue
            if not isinstance(value, str) or not value:
                raise PayloadRejected(f"{where} {part}", "invalid", "must be a non-empty string")
            limits.check_name(f"{where} {part}", value)
            size += len(limits.encode(f"{where} {part}", value).encode())
        size += len(limits.encode(f"{where} ({event.type}) payload", event.payload).encode())
    return size


def _reraise_own_cancellation(exc: BaseException) -> None:
    """The worker cancelling this segment (drain) must go through; a handler's own
    CancelledError (raised while nobody cancelled the segment) is an error like any other."""
    if isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise exc


def raised(error: BaseException, *, retryable: bool, engine: tuple[str, ...] = ()) -> StepFailed:
    """What a handler (a step's or a compensation's, called from `engine`) raised, as its failure: type,
    message and the frames below the engine's call (`handler_frames`)."""
    frames, omitted = handler_frames(error, engine)
    return replace(_failed(type(error).__name__, _message(error), retryable=retryable), frames=frames,
                   frames_omitted=omitted, cause=_cause(error, engine, frames, {id(error)}, MAX_CAUSES))


def _cause(error: BaseException, engine: tuple[str, ...], kept: tuple[Frame, ...], seen: set[int],
           links: int) -> dict[str, Any] | None:
    """What `error` was raised from (or while handling, unless `from None`), as Python prints the chain:
    its frames from what the caps leave once `kept` are counted, then its own cause, `links` deep at most."""
    context = error.__cause__ is None
    cause = error.__context__ if context and not error.__suppress_context__ else error.__cause__
    if cause is None or id(cause) in seen or links < 1:
        return None
    seen.add(id(cause))
    frames, omitted = handler_frames(cause, engine, MAX_FRAMES - len(kept), MAX_FRAMES_BYTES - frames_bytes(kept))
    return {"type": _storable(type(cause).__name__)[:200], "message": _storable(_message(cause)),
            **({"frames": [f.document() for f in frames]} if frames else {}),
            **({"frames_omitted": omitted} if omitted else {}), **({"context": True} if context else {}),
            **({"cause": deeper} if (deeper := _cause(cause, engine, kept + frames, seen, links - 1)) else {})}


def handler_frames(error: BaseException, engine: tuple[str, ...] = (), most: int = MAX_FRAMES,
                   most_bytes: int = MAX_FRAMES_BYTES) -> tuple[tuple[Frame, ...], int]:
    """Where the handler raised `error` (`core.failures`): its traceback below the engine's call of the
    handler (the leading frames in this module and the `engine` files that call it are dropped), bounded;
    and how many outer frames were left out. Source lines are read as Python's traceback reads them
    (`linecache`), local variables never."""
    calling = {__file__, *engine}
    try:
        summary = traceback.extract_tb(error.__traceback__)
    except Exception:  # noqa: BLE001 - a source that cannot be read must not lose the failure itself
        return (), 0
    start = 0
    while start < len(summary) and summary[start].filename in calling:
        start += 1
    return bounded([Frame(_storable(s.filename), s.lineno or 0, _storable(s.name), _storable(s.line or ""))
                    for s in summary[start:]], most, most_bytes)


def _failed(error_type: str, message: str, *, retryable: bool) -> StepFailed:
    return StepFailed(_storable(error_type)[:200], _storable(message), retryable=retryable)


def _storable(text: str) -> str:
    """Text PostgreSQL can store: no NUL, no lone surrogate (both written as escapes)."""
    text = text.replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def describe_error(exc: BaseException) -> str:
    """`Type: first line of the message`, storable in PostgreSQL."""
    message = _message(exc)
    return _storable(f"{type(exc).__name__}: {message}" if message else type(exc).__name__)


def _message(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not crash the segment
        return "(the error's message could not be read)"
    text = text.splitlines()[0] if text.strip() else ""
    return text[:_MAX_MESSAGE]
