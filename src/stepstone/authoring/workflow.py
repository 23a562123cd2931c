"""Define workflows in Python.

    wf = Workflow("order", version=1, state=Order)

    @wf.step(start=True, next="await_payment")
    async def reserve(ctx: StepContext, state: Order) -> None: ...

    wf.wait("await_payment", signals={"paid": "ship"}, timeout=timedelta(days=1), on_timeout="release")

A workflow collects steps and becomes an immutable `Plan` the first time the
engine asks for it; after that it can no longer change.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Generic, TypeVar, overload

from pydantic import BaseModel, ValidationError

from stepstone.authoring.sensitive import sensitive_paths
from stepstone.authoring.step_context import (
    BranchInfo,
    ChildResult,
    CompensationContext,
    ExternalResult,
    Retry,
    Signal,
    StepContext,
    TaskOutcome,
    _seconds,
    from_item,
    from_state,
)
from stepstone.core import json_text
from stepstone.core.plan import DEFAULT_MAX_ITEMS, END, Compensation, Plan, Step, too_long
from stepstone.core.redaction import Redaction
from stepstone.core.task_spec import TaskSpec
from stepstone.errors import DefinitionError, InvalidInput

__all__ = [  # the handler-facing types live in step_context and are re-exported here
    "BranchInfo", "ChildResult", "CompensationContext", "ExternalResult", "Registry", "Retry", "Signal",
    "StepContext", "TaskOutcome", "Workflow", "from_item", "from_state",
]

S = TypeVar("S")
Handler = Callable[["StepContext", Any], "Awaitable[str | None] | str | None"]
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class _ActionSpec:
    handler: Callable[..., Any]
    non_retryable: tuple[type[BaseException], ...]
    is_async: bool = field(init=False)

    def __post_init__(self) -> None:  # asked on every step: inspect once, at registration
        object.__setattr__(self, "is_async", inspect.iscoroutinefunction(self.handler))


class Workflow(Generic[S]):
    """A named, versioned graph of steps over a state model."""

    def __init__(
        self, id: str, *, version: int = 1, state: type[S] | None = None,  # noqa: A002
        redact: Callable[[str], str] | None = None,
        deadline: timedelta | float | None = None,
    ) -> None:
        """`redact` is the redaction hook: every text bound for history or an error goes through it
        (after the fields the state model marks `Sensitive` are taken out; docs/operations.md).
        `deadline` is the default instance deadline (`Client.start(deadline=...)` overrides it)."""
        self.id = id
        self.version = version
        if state is not None and not (isinstance(state, type) and issubclass(state, BaseModel)):
            raise DefinitionError(f"workflow {id!r}: state must be a pydantic model class (or None for a dict), "
                                  f"got {state!r}")  # it was found at the first start
        self.state_model = state
        self.redaction = Redaction(sensitive_paths(state), redact)
        self.deadline = None if deadline is None else _seconds(deadline)
        """The default instance deadline in seconds."""
        if problem := too_long(f"workflow {id!r}: its deadline", self.deadline):
            raise DefinitionError(problem[0])
        if self.deadline is not None and self.deadline < 0:  # every start refused it, not the definition
            raise DefinitionError(f"workflow {id!r}: its deadline must not be negative, got {self.deadline:g} s")
        self._steps: list[Step] = []
        self._actions: dict[str, _ActionSpec] = {}
        self._compensations: dict[str, _ActionSpec] = {}
        self._start: str | None = None
        self._plan: Plan | None = None
        self._payload_models: dict[tuple[str, str], type[BaseModel]] = {}

    def __repr__(self) -> str:
        return f"<Workflow {self.id} v{self.version}>"

    # -- authoring -------------------------------------------------------------------------

    @overload
    def step(self, fn: F, /) -> F: ...
    @overload
    def step(
        self,
        fn: None = None,
        /,
        *,
        name: str | None = None,
        next: str | Sequence[str] | None = None,
        start: bool = False,
        retry: Retry | None = None,
        deadline: timedelta | float | None = None,
        on_deadline: str | None = None,
    ) -> Callable[[F], F]: ...
    def step(
        self,
        fn: Callable[..., Any] | None = None,
        /,
        *,
        name: str | None = None,
        next: str | Sequence[str] | None = None,  # noqa: A002
        start: bool = False,
        retry: Retry | None = None,
        deadline: timedelta | float | None = None,
        on_deadline: str | None = None,
    ) -> Any:
        """Declare an action step. The handler `(ctx, state)` returns the next step's name,
        or None when `next` names a single step (or none: the step then ends the instance).
        `deadline`: the step (all its attempts) must finish within it; when it passes, a handler
        still running is fenced and the position goes to `on_deadline`, or the step fails."""

        def register(handler: Callable[..., Any]) -> Callable[..., Any]:
            step_name = _handler_name(handler, name)
            _check_takes(f"step {step_name!r}", handler, "ctx", "state")
            targets = _targets(step_name, next)
            policy = _retry(retry)
            seconds = None if deadline is None else _seconds(deadline)
            self._add(Step(step_name, "action", targets, retry=policy.policy(), deadline_seconds=seconds,
                           on_deadline=on_deadline), start)
            self._actions[step_name] = _ActionSpec(handler, policy.non_retryable)
            return handler

        return register(fn) if fn is not None else register

    def timer(
        self,
        name: str,
        *,
        next: str,  # noqa: A002
        delay: timedelta | float | None = None,
        until: str | None = None,
        start: bool = False,
        deadline: timedelta | float | None = None,
        on_deadline: str | None = None,
    ) -> None:
        """Declare a timer step: sleep for `delay`, or until the instant in state field `until`;
        `deadline` bounds it (an `until` read from state may lie further out): then `on_deadline`."""
        model = self.state_model
        if until is not None and isinstance(model, type) and issubclass(model, BaseModel) \
                and model.model_config.get("extra") != "allow" and until not in model.model_fields:
            raise DefinitionError(f"timer {name!r}: until names state field {until!r}, which {model.__name__} lacks; "
                                  f"its fields: {', '.join(model.model_fields)}")
        seconds = None if delay is None else _seconds(delay)
        self._add(Step(name, "timer", (next,), delay_seconds=seconds, until=until,
                       deadline_seconds=None if deadline is None else _seconds(deadline), on_deadline=on_deadline),
                  start)

    def wait(
        self,
        name: str,
        *,
        signals: Mapping[str, str] | None = None,
        timeout: timedelta | float | None = None,
        on_timeout: str | None = None,
        start: bool = False,
        messages: Mapping[str, str] | None = None,
        correlation: str | None = None,
        payloads: Mapping[str, type[BaseModel]] | None = None,
        deadline: timedelta | float | None = None,
        on_deadline: str | None = None,
    ) -> None:
        """Declare a wait step: the first accepted signal moves on to its step. `messages` (name ->
        step) subscribes to published messages whose correlation key is the state value at
        `correlation` (a dotted path), read when the wait is entered. `payloads` names the pydantic
        model of a signal's or message's payload: its fields marked `Sensitive` are redacted from
        every stored copy once the handler has it (docs/operations.md, Redaction). `deadline`: the
        wait must be left within it, or it goes to `on_deadline` (without one, the step fails: a saga
        compensates)."""
        for signal, model in _pairs(name, "payloads", payloads).items():
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                raise DefinitionError(f"wait {name!r}: the payload of {signal!r} must be a pydantic model class")
            self.redaction = self.redaction.with_payload(("signal", signal), sensitive_paths(model))
        seconds = None if timeout is None else _seconds(timeout)
        self._add(Step(name, "wait", signals=_pairs(name, "signals", signals), timeout_seconds=seconds,
                       on_timeout=on_timeout, messages=_pairs(name, "messages", messages), correlation=correlation,
                       deadline_seconds=None if deadline is None else _seconds(deadline), on_deadline=on_deadline),
                  start)

    def task(
        self,
        name: str,
        *,
        title: str,
        decisions: Mapping[str, str],
        payloads: Mapping[str, type[BaseModel]] | None = None,
        description: str = "",
        assignee: str | dict[str, str] | None = None,
        owner: str | dict[str, str] | None = None,
        candidate_users: Sequence[str] | dict[str, str] = (),
        candidate_groups: Sequence[str] | dict[str, str] = (),
        priority: int | dict[str, str] = 50,
        show: Sequence[str] = (),
        due: timedelta | float | dict[str, str] | None = None,
        follow_up: timedelta | float | dict[str, str] | None = None,
        reminder: timedelta | float | None = None,
        escalate_to_user: str | None = None,
        escalate_to_group: str | None = None,
        expire: timedelta | float | None = None,
        on_expire: str | None = None,
        require_version_stability: bool = False,
        start: bool = False,
    ) -> None:
        """Declare a human task step: a person completes it with one of `decisions` (name -> next step),
        with a payload validated by `payloads[decision]` (a pydantic model) when given. Attributes marked
        with `from_state(path)` are read from the state when the task opens; `show` lists the state
        fields the assignee sees. When `due`, the task goes to `escalate_to_user`/`_group`; after
        `expire` it expires to `on_expire`."""
        models = _pairs(name, "payloads", payloads)
        for decision, model in models.items():
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                raise DefinitionError(f"task {name!r}: the payload of {decision!r} must be a pydantic model class")
            self._payload_models[(name, decision)] = model
            self.redaction = self.redaction.with_payload(("task", name, decision), sensitive_paths(model))
        spec = TaskSpec(
            title=title, description=description, assignee=assignee, owner=owner,
            candidate_users=_names(candidate_users), candidate_groups=_names(candidate_groups),
            priority=priority, show=tuple(show),
            forms={d: m.model_json_schema() for d, m in sorted(models.items())},
            due=_when(due), follow_up=_when(follow_up),
            reminder_seconds=None if reminder is None else _seconds(reminder),
            escalate_user=escalate_to_user, escalate_group=escalate_to_group,
            expire_seconds=None if expire is None else _seconds(expire), on_expire=on_expire,
            require_version_stability=require_version_stability,
        )
        self._add(Step(name, "task", decisions=_pairs(name, "decisions", decisions), task=spec), start)

    def payload_model(self, step: str, decision: str) -> type[BaseModel] | None:
        """The pydantic model of a task decision's payload, when the step declared one."""
        return self._payload_models.get((step, decision))

    def fork(
        self,
        name: str,
        *,
        branches: Mapping[str, str] | None = None,
        map_over: str | None = None,
        branch: str | None = None,
        max_items: int = DEFAULT_MAX_ITEMS,
        start: bool = False,
    ) -> None:
        """Declare a fork: parallel `branches` (name -> first step), or one branch per item of the
        state list `map_over`, each starting at step `branch`. Branches end at the fork's join."""
        self._add(Step(name, "fork", branches=_pairs(name, "branches", branches), map_over=map_over, branch_step=branch,
                       max_items=max_items), start)

    def join(self, name: str, *, fork: str, next: str, need: int | str = "all") -> None:  # noqa: A002
        """Declare the join of `fork`: when all branches (`need="all"`), any one (`"any"`) or `need`
        of them reached it, the fork's position goes on to `next`; the branches still running are
        cancelled. Branch steps go to this step's name to end their branch."""
        count = 0 if need == "all" else 1 if need == "any" else need
        if not isinstance(count, int) or isinstance(count, bool) or (count < 1 and need != "all"):
            # (0 is how the plan spells "all": need=0 meant every branch, not none)
            raise DefinitionError(f"join {name!r}: need must be 'all', 'any' or a count of 1 or more, got {need!r}")
        self._add(Step(name, "join", (next,), fork=fork, need=count), False)

    @overload
    def child(self, fn: F, /) -> F: ...
    @overload
    def child(
        self,
        fn: None = None,
        /,
        *,
        workflow: str,
        next: str,
        name: str | None = None,
        on_failure: str | None = None,
        cancel_with_parent: bool = True,
        start: bool = False,
    ) -> Callable[[F], F]: ...
    def child(
        self,
        fn: Callable[..., Any] | None = None,
        /,
        *,
        workflow: str = "",
        next: str = "",  # noqa: A002
        name: str | None = None,
        on_failure: str | None = None,
        cancel_with_parent: bool = True,
        start: bool = False,
    ) -> Any:
        """Declare a child step. The handler `(ctx, state)` returns the child's input (a dict or a
        model of the child's state); the child starts in this step's commit, and the position
        waits for its end. The next step's handler finds it in `ctx.child`. A failed or cancelled
        child goes to `on_failure`, or fails this position when there is none. Cancelling the
        parent cancels the child unless `cancel_with_parent=False` (the child is then abandoned)."""

        def register(handler: Callable[..., Any]) -> Callable[..., Any]:
            step_name = _handler_name(handler, name)
            _check_takes(f"step {step_name!r}", handler, "ctx", "state")
            step = Step(step_name, "child", (next,), workflow=workflow, on_failure=on_failure,
                        cancel_with_parent=cancel_with_parent)
            self._add(step, start)
            self._actions[step_name] = _ActionSpec(handler, ())
            return handler

        return register(fn) if fn is not None else register

    def external(
        self,
        name: str,
        *,
        topic: str,
        next: str,  # noqa: A002
        inputs: Sequence[str] | None = None,
        errors: Mapping[str, str] | None = None,
        retry: Retry | None = None,
        start: bool = False,
    ) -> None:
        """Declare an external step: a task on `topic` that outside workers, in any language, fetch
        and lock, then complete, fail or answer with a business error (`stepstone.external`, or
        HTTP through `stepstone external serve`). Workers receive the state, or only the fields
        `inputs`; the variables they complete with are merged into the state. `errors` maps a
        business error code to the step it leads to; `retry` sets how many failures are allowed
        (max_attempts) and the delay before the task is offered again, then the position fails."""
        policy = _retry(retry).policy()
        self._add(Step(name, "external", (next,), retry=policy, topic=topic,
                       inputs=None if inputs is None else tuple(inputs), errors=_pairs(name, "errors", errors)), start)

    def compensation(
        self, step: str, *, retry: Retry | None = None, name: str | None = None
    ) -> Callable[[F], F]:
        """Declare the compensation of action step `step`: `(ctx, state, recorded)`, sync or async,
        with `ctx` a `CompensationContext`, `state` the state as it is when compensating and
        `recorded` what the step kept with `ctx.record`. When the saga compensates, the completed
        steps that declare one are undone in reverse order of completion, each retried under
        `retry` (default `Retry()`); the state it leaves is kept."""

        def register(handler: F) -> F:
            if self._plan is not None:
                raise DefinitionError(f"workflow {self.id!r} v{self.version} is already in use and cannot change")
            found = next((n for n, s in enumerate(self._steps) if s.name == step), None)
            if found is None or self._steps[found].kind != "action":
                raise DefinitionError(f"workflow {self.id!r}: compensation for {step!r}, which is no action step "
                                      "declared before it")
            if step in self._compensations:
                raise DefinitionError(f"workflow {self.id!r}: step {step!r} has two compensations")
            policy = _retry(retry)
            declared = Compensation(_handler_name(handler, name), policy.policy())
            _check_takes(f"the compensation of step {step!r}", handler, "ctx", "state", "recorded")
            self._steps[found] = replace(self._steps[found], compensation=declared)
            self._compensations[step] = _ActionSpec(handler, policy.non_retryable)
            return handler

        return register

    def _add(self, step: Step, start: bool) -> None:
        if self._plan is not None:
            raise DefinitionError(f"workflow {self.id!r} v{self.version} is already in use and cannot change")
        if start:
            if self._start is not None:
                raise DefinitionError(f"workflow {self.id!r}: both {self._start!r} and {step.name!r} are marked start")
            self._start = step.name
        self._steps.append(step)

    # -- what the engine reads ---------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        """The validated plan; building it freezes the workflow."""
        if self._plan is None:
            start = self._start or (self._steps[0].name if len(self._steps) == 1 else None)
            try:
                self._plan = Plan.build(self.id, self.version, start, self._steps)
            except ValueError as exc:
                raise DefinitionError(str(exc)) from None
        return self._plan

    def handler(self, step: str) -> Callable[..., Any]:
        return self._actions[step].handler

    def is_async(self, step: str) -> bool:
        return self._actions[step].is_async

    def compensation_handler(self, step: str) -> Callable[..., Any] | None:
        spec = self._compensations.get(step)
        return None if spec is None else spec.handler

    def compensation_never_retried(self, step: str, error: BaseException) -> bool:
        spec = self._compensations.get(step)
        return spec is not None and isinstance(error, spec.non_retryable)

    def never_retried(self, step: str, error: BaseException) -> bool:
        return isinstance(error, self._actions[step].non_retryable)

    def state_to_json(self, value: Any, *, what: str = "input") -> Any:
        """Validate `value` (a model instance or a dict) against the state model; JSON out.

        A model instance is validated again from its JSON: mutating a model does not re-validate
        it, so a handler may have left it in a shape the model forbids. `what` names the value
        in the error (the start input, or the state a step left).
        """
        return self.state_document(value, what=what)[0]

    def state_document(self, value: Any, *, what: str = "input") -> tuple[Any, str | None]:
        """`state_to_json`, with the JSON text the state model wrote on the way (None without a model):
        the state a step leaves is checked against the limits from that text, not encoded again."""
        model = self.state_model
        if model is None:
            if not isinstance(value, dict):
                raise InvalidInput(f"workflow {self.id!r} takes a JSON object as {what}, got {type(value).__name__}")
            return value, None
        if isinstance(model, type) and issubclass(model, BaseModel):
            try:
                if isinstance(value, model):
                    # Without pydantic's warnings: a value of the wrong type is the validation's error just
                    # below, named by field, not a UserWarning (an exception where warnings are errors).
                    text = value.model_dump_json(warnings=False)
                    model.model_validate_json(text)
                    return json_text.loads(text), text
                return model.model_validate(value).model_dump(mode="json"), None
            except ValidationError as exc:
                raise InvalidInput(f"{what} for workflow {self.id!r} is invalid: {_brief(exc)}") from None
            except (ValueError, UnicodeError, RecursionError) as exc:  # too deep, lone surrogates
                message = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                raise InvalidInput(f"{what} of workflow {self.id!r} cannot be stored as JSON: {message}") from None
        raise DefinitionError(f"workflow {self.id!r}: state must be a pydantic model class")

    def state_from_json(self, data: Any) -> Any:
        model = self.state_model
        if model is None:
            # A copy: the handler mutates it, and the stored snapshot must stay as it was for the patch.
            return copy.deepcopy(data)
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise DefinitionError(f"workflow {self.id!r}: state must be a pydantic model class")
        return model.model_validate(data)

    def end(self) -> str:
        """The step name that ends the instance, for handlers that choose to stop."""
        return END

    def registration_document(self) -> dict[str, Any]:
        """The plan document the store keeps, with the sensitive paths the database and the operator's
        views redact by (of the state, and of each payload model; not part of the plan's hash)."""
        return {**self.plan.document(), **self.redaction.document_fields()}


def _handler_name(handler: Any, name: str | None) -> str:
    """The step's name: `name`, or the handler's own (an empty `name` is refused as a name, not replaced)."""
    if not callable(handler):
        raise DefinitionError(f"step {name or handler!r}: the handler must be a function, got {handler!r}")
    if name is None and not isinstance(getattr(handler, "__name__", None), str):  # a partial, a callable object
        raise DefinitionError(f"the step of handler {handler!r} needs a name: it has no __name__ (pass name=...)")
    return handler.__name__ if name is None else name


def _check_takes(what: str, handler: Callable[..., Any], *args: str) -> None:
    """Refuse a handler that cannot be called as the engine calls it, `handler(*args)`: it would fail with a
    TypeError at run time, retried as if transient. *args, defaults, partials and bound methods are fine."""
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):  # some builtins have no signature to read: left to run time
        return
    try:
        signature.bind(*args)
    except TypeError as exc:
        shown = ", ".join(str(p.replace(annotation=p.empty)) for p in signature.parameters.values())
        name = getattr(handler, "__qualname__", "") or type(handler).__name__
        raise DefinitionError(f"{what}: the handler {name}({shown}) cannot be called with ({', '.join(args)}): "
                              f"{exc}") from None


def _targets(step: str, next: Any) -> tuple[Any, ...]:  # noqa: A002
    """`next` as the plan keeps it: one step's name, several, or none (the plan checks each is a name)."""
    if next is None or isinstance(next, str):
        return () if next is None else (next,)
    if isinstance(next, Sequence):
        return tuple(next)
    raise DefinitionError(f"step {step!r}: next must name a step or a list of steps, got {next!r}")


def _pairs(step: str, what: str, value: Any) -> dict[Any, Any]:
    """A mapping argument as a dict (a list of names made a dict of their letters: ["go"] -> {"g": "o"})."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise DefinitionError(f"step {step!r}: {what} must map names to steps, got {value!r}")
    return dict(value)


def _retry(retry: Any) -> Retry:
    """The step's retry policy: a `Retry`, or the default (a dict or a number reached `.policy()` and
    failed there with an AttributeError)."""
    if retry is None:
        return Retry()
    if not isinstance(retry, Retry):
        raise DefinitionError(f"retry=... takes a Retry(...), got {retry!r}")
    return retry


class Registry:
    """The workflows a worker can run and a client can start, by id and version."""

    def __init__(self, *workflows: Workflow[Any]) -> None:
        self._by_key: dict[tuple[str, int], Workflow[Any]] = {}
        self._definition_ids: frozenset[str] = frozenset()
        for wf in workflows:
            self.add(wf)

    def add(self, workflow: Workflow[Any]) -> Workflow[Any]:
        if not isinstance(workflow, Workflow):
            hint = ": pass them one by one, Registry(a, b), or unpack, Registry(*workflows)" \
                if isinstance(workflow, list | tuple | set) else ""
            raise DefinitionError(f"a registry holds workflows, not a {type(workflow).__name__}{hint}")
        key = (workflow.id, workflow.version)
        if key in self._by_key and self._by_key[key] is not workflow:
            raise DefinitionError(f"workflow {workflow.id!r} v{workflow.version} is registered twice")
        workflow.plan  # noqa: B018 - validate now, not at first use
        self._by_key[key] = workflow
        self._definition_ids |= {workflow.plan.definition_id}
        return workflow

    @property
    def definition_ids(self) -> frozenset[str]:
        """The definition ids of the registered workflows, any version (what a worker serves)."""
        return self._definition_ids

    def check_children(self) -> None:
        """Every workflow a child step starts is registered here too; DefinitionError otherwise."""
        known = {wf.id for wf in self._by_key.values()}
        missing = sorted(
            f"{wf.id} v{wf.version} starts {child!r}"
            for wf in self._by_key.values() for child in wf.plan.child_workflows if child not in known
        )
        if missing:
            raise DefinitionError("child workflows not registered: " + "; ".join(missing))

    def __iter__(self) -> Any:
        return iter(self._by_key.values())

    def __len__(self) -> int:
        return len(self._by_key)

    def latest(self, definition_id: str) -> Workflow[Any] | None:
        versions = [wf for (i, _), wf in self._by_key.items() if i == definition_id]
        return max(versions, key=lambda wf: wf.version) if versions else None

    def find(self, definition_id: str, version: int, plan_hash: str | None = None) -> Workflow[Any] | None:
        """The workflow for a pin; None when this node lacks it or runs different structure."""
        wf = self._by_key.get((definition_id, version))
        if wf is None or (plan_hash is not None and wf.plan.plan_hash != plan_hash):
            return None
        return wf



def _names(value: Sequence[str] | dict[str, str]) -> Any:
    return value if isinstance(value, dict) else tuple(value)


def _when(value: timedelta | float | dict[str, str] | None) -> Any:
    return _seconds(value) if isinstance(value, timedelta | int | float) else value



def _brief(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(p) for p in err.get("loc", ())) or "input"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    more = exc.error_count() - 3
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
