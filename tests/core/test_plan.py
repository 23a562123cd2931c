"""Plan validation and hashing, without a database."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepstone.authoring.workflow import Registry, Retry, StepContext, Workflow
from stepstone.core.plan import END, Plan, PlanError, RetryPolicy, Step
from stepstone.errors import DefinitionError


def action(name: str, *targets: str, retry: RetryPolicy | None = None) -> Step:
    return Step(name, "action", targets, retry=retry or RetryPolicy())


def build(*steps: Step, start: str | None = "a") -> Plan:
    return Plan.build("wf", 1, start, list(steps))


@pytest.mark.parametrize(
    ("steps", "start", "problem"),
    [
        ((action("a", "ghost"),), "a", "step 'a' goes to unknown step 'ghost'"),
        ((action("a", END), action("island", END)), "a", "unreachable steps: island"),
        ((action("a", END),), None, "no start step"),
        ((action("a", END),), "nowhere", "start step 'nowhere' is not defined"),
        ((action("a", "a"), action("a", END)), "a", "step 'a' is defined twice"),
        ((action("a", "w"), Step("w", "wait")), "a", "wait step 'w' accepts no signal"),
        ((), "a", "no steps"),
        ((action("a", "t"), Step("t", "timer", (END,))), "a", "timer step 't' needs exactly one of delay or until"),
        ((action("a", "t"), Step("t", "timer", (END,), delay_seconds=-1)), "a", "negative delay"),
        # A delay of 1e300 failed every commit that set its timer, until the command was dead-lettered.
        ((action("a", "t"), Step("t", "timer", (END,), delay_seconds=float("inf"))), "a",
         "step 't': its delay must be at most a thousand years, got inf s"),
        ((action("a", "t"), Step("t", "timer", (END,), delay_seconds=float("nan"))), "a", "got nan s"),
        ((action("a", "w"), Step("w", "wait", signals={"go": END}, timeout_seconds=1e300, on_timeout=END)), "a",
         "step 'w': its timeout must be at most a thousand years"),
        ((Step("a", "action", (END,), deadline_seconds=4e10),), "a", "step 'a': its deadline must be at most"),
        ((Step("a", "action", (END,), retry=RetryPolicy(max_backoff=float("inf"))),), "a",
         "max_backoff must be at most a thousand years"),
        # NaN and inf backoffs and multipliers were accepted, and the registry stored them as null.
        ((Step("a", "action", (END,), retry=RetryPolicy(initial_backoff=float("nan"))),), "a",
         "step 'a': backoff must be at most a thousand years, got nan s"),
        ((Step("a", "action", (END,), retry=RetryPolicy(initial_backoff=float("inf"))),), "a",
         "step 'a': backoff must be at most a thousand years, got inf s"),
        ((Step("a", "action", (END,), retry=RetryPolicy(multiplier=float("nan"))),), "a",
         "step 'a': multiplier must be a number of at least 1, got nan"),
        ((Step("a", "action", (END,), retry=RetryPolicy(multiplier=float("inf"))),), "a",
         "step 'a': multiplier must be a number of at least 1, got inf"),
        (
            (action("a", "w"), Step("w", "wait", signals={"go": END}, timeout_seconds=5)),
            "a",
            "timeout and on_timeout go together",
        ),
        ((action("a", END, retry=RetryPolicy(max_attempts=0)),), "a", "max_attempts must be at least 1"),
        ((action("bad name", END),), "bad name", "invalid step name 'bad name'"),
    ],
)
def test_invalid_plans_are_refused_with_the_problem_named(steps: tuple[Step, ...], start: str, problem: str) -> None:
    with pytest.raises(PlanError, match=problem.replace("(", r"\(")):
        Plan.build("wf", 1, start, list(steps))


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(PlanError) as err:
        build(action("a", "ghost"), action("island", END), Step("w", "wait"))
    message = str(err.value)
    assert "unknown step 'ghost'" in message and "unreachable steps: island, w" in message
    assert "accepts no signal" in message


def test_authoring_errors_surface_as_definition_errors() -> None:
    wf: Workflow[None] = Workflow("broken")

    @wf.step(start=True, next="missing")
    def first(ctx: StepContext, state: None) -> None: ...

    with pytest.raises(DefinitionError, match="unknown step 'missing'"):
        Registry(wf)

    twice: Workflow[None] = Workflow("twice")
    twice.wait("w", signals={"go": END}, start=True)
    with pytest.raises(DefinitionError, match="both 'w' and 'x' are marked start"):
        twice.wait("x", signals={"go": END}, start=True)


def _order_workflow(body: int, *, delay: float = 300, attempts: int = 3, signal: str = "paid") -> Workflow[None]:
    wf: Workflow[None] = Workflow("order", version=1)

    @wf.step(start=True, next="pause", retry=Retry(max_attempts=attempts))
    def reserve(ctx: StepContext, state: None) -> None:
        if body == 1:
            print("one body")  # noqa: T201
        else:
            _ = [i * i for i in range(body)]

    wf.timer("pause", delay=timedelta(seconds=delay), next="wait_pay")
    wf.wait("wait_pay", signals={signal: "ship", "cancel": "refund"}, timeout=60, on_timeout="refund")

    @wf.step(next=None)
    def ship(ctx: StepContext, state: None) -> None: ...

    @wf.step(next=None)
    def refund(ctx: StepContext, state: None) -> None: ...

    return wf


def test_plan_hash_covers_structure_not_handler_bodies() -> None:
    base = _order_workflow(1).plan.plan_hash
    assert _order_workflow(2).plan.plan_hash == base
    assert _order_workflow(3).plan.plan_hash == base
    changed = {
        _order_workflow(1, delay=301).plan.plan_hash,
        _order_workflow(1, attempts=4).plan.plan_hash,
        _order_workflow(1, signal="settled").plan.plan_hash,
    }
    assert base not in changed and len(changed) == 3

    v2: Workflow[None] = Workflow("order", version=2)
    v2.wait("w", signals={"go": END}, start=True)
    v1: Workflow[None] = Workflow("order", version=1)
    v1.wait("w", signals={"go": END}, start=True)
    assert v1.plan.plan_hash != v2.plan.plan_hash


def test_plan_hash_does_not_depend_on_declaration_order() -> None:
    one = build(action("a", "b"), action("b", END))
    two = Plan.build("wf", 1, "a", [action("b", END), action("a", "b")])
    assert one.plan_hash == two.plan_hash


def test_plan_hash_is_stable_across_processes() -> None:
    code = "from tests.engine.workflows import registry; print(*(w.plan.plan_hash for w in registry))"
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""}, cwd=Path(__file__).parents[2],
        ).stdout
        for seed in ("1", "2", "random")
    }
    assert len(outputs) == 1
    from tests.engine.workflows import registry  # noqa: PLC0415

    assert outputs.pop().split() == [w.plan.plan_hash for w in registry]


@settings(deadline=None)  # a loaded 2-core machine makes per-example timing meaningless
@given(
    initial=st.floats(0, 1e4, allow_nan=False),
    multiplier=st.floats(1, 10, allow_nan=False),
    cap=st.floats(0, 1e6, allow_nan=False),
    attempt=st.integers(1, 100_000),
)
def test_backoff_is_monotone_and_capped(initial: float, multiplier: float, cap: float, attempt: int) -> None:
    policy = RetryPolicy(max_attempts=attempt + 1, initial_backoff=initial, multiplier=multiplier, max_backoff=cap)
    now, later = policy.backoff(attempt), policy.backoff(attempt + 1)
    assert 0 <= now <= later <= cap
    assert policy.backoff(1) == min(initial, cap)


def test_a_registry_given_a_list_says_how_to_pass_workflows() -> None:
    wf = Workflow("listed", version=1)
    wf.timer("pause", delay=1, next="$end", start=True)
    with pytest.raises(DefinitionError, match=r"not a list: pass them one by one, Registry\(a, b\)"):
        Registry([wf])  # type: ignore[arg-type]  # was AttributeError: 'list' object has no attribute 'id'
    assert Registry(*[wf]).find("listed", 1) is wf
