"""Which transitions fold into the step they enter, and what the folded decision holds (core.folding)."""

from __future__ import annotations

from stepstone.core.effects import (
    CloseTimers,
    Enqueue,
    MovePosition,
    RecordHistory,
    ScheduleStepDeadline,
    SetState,
    WithinStepDeadline,
)
from stepstone.core.folding import fold, foldable
from stepstone.core.model import CommandView, Decision, Settle, StepFailed, StepSucceeded
from stepstone.core.plan import END, Plan, Step
from stepstone.core.transitions import advance, apply, complete_step
from tests.core.test_transitions import NOW, PLAN, inst, waiting_at


def _signal(name: str) -> Decision:
    out = apply(waiting_at("await_pay"), CommandView(7, "SIGNAL", name=name, payload={"p": 1}), PLAN, NOW)
    assert isinstance(out, Decision)
    return out


def _step(transition: Decision, outcome: StepSucceeded | StepFailed) -> Decision:
    follow = transition.continuation
    assert follow is not None
    entered = advance(waiting_at("await_pay"), transition, 0)
    return complete_step(entered, CommandView(7, "STEP", follow.step, follow.visit, payload=follow.payload), PLAN,
                         outcome, NOW)


def test_a_signal_into_an_action_step_folds() -> None:
    assert foldable(_signal("paid"))


def test_a_signal_to_the_end_or_a_transition_with_more_than_a_move_does_not_fold() -> None:
    assert not foldable(_signal("void"))  # no continuation: the instance ends in that commit
    plain = _signal("paid")
    assert not foldable(Decision(plain.settle, (*plain.effects, SetState({"n": 2}))))
    assert not foldable(Decision(plain.settle, (*plain.effects, Enqueue("TIMER", "ship", 4, name="x", delay=1))))
    assert not foldable(Decision(Settle("PARKED"), plain.effects))


def test_the_folded_decision_settles_the_signal_and_keeps_the_steps_move_and_continuation() -> None:
    transition = _signal("paid")
    step = _step(transition, StepSucceeded(None, {"n": 2}))
    folded = fold(transition, step)
    assert folded is not None and folded.settle == transition.settle
    assert [h.kind for h in folded.of(RecordHistory)] == ["SIGNAL_APPLIED", "STEP_COMPLETED", "INSTANCE_COMPLETED"]
    assert folded.of(MovePosition) == step.of(MovePosition) and folded.continuation is None
    assert folded.of(CloseTimers) == [CloseTimers()] and folded.first(SetState) == step.first(SetState)
    moved = folded.first(MovePosition)
    assert moved is not None and (moved.status, moved.step) == ("COMPLETED", None)  # "ship" goes to the end


def test_a_step_that_retries_or_fails_does_not_fold() -> None:
    """Its own command carries the retry (put back) or the failure: the transition commits first."""
    transition = _signal("paid")
    failed = _step(transition, StepFailed("Boom", "no", retryable=False))
    assert failed.settle.state == "FAILED" and fold(transition, failed) is None
    retry = Decision(Settle("RETRY", "Boom: no", retry_delay=1.0), (RecordHistory("STEP_FAILED", "ship", 4),))
    assert fold(transition, retry) is None


_TIMED = Plan.build(
    "timed", 1, "await_pay",
    [
        Step("await_pay", "wait", signals={"paid": "ship", "rush": "rushed"}, deadline_seconds=60,
             on_deadline="give_up"),
        Step("ship", "action", (END,)),
        Step("rushed", "action", (END,), deadline_seconds=5, on_deadline="give_up"),
        Step("give_up", "action", ()),
    ],
)


_TIMED_WAIT = inst("WAITING", "await_pay", 3,
                   wait={"kind": "signal", "signals": dict(_TIMED.steps["await_pay"].signals)})


def _timed_signal(name: str) -> Decision:
    out = apply(_TIMED_WAIT, CommandView(7, "SIGNAL", name=name), _TIMED, NOW)
    assert isinstance(out, Decision)
    return out


def test_a_signal_leaving_a_wait_with_a_deadline_folds_and_the_commit_holds_the_waits_deadline() -> None:
    """The commit that folds the step in is the signal's: it says how the signal settles if the wait's deadline
    has left the wait first (parked, migration 0061), and the step's handler commits nothing then."""
    transition = _timed_signal("paid")
    assert foldable(transition)
    held = transition.first(WithinStepDeadline)
    assert held is not None and (held.step, held.visit, held.late_settle) == ("await_pay", 3, "PARKED")
    assert [h.kind for h in held.late_history] == ["SIGNAL_PARKED"]
    follow = transition.continuation
    assert follow is not None
    entered = advance(_TIMED_WAIT, transition, 0)
    step = complete_step(entered, CommandView(7, "STEP", follow.step, follow.visit), _TIMED,
                         StepSucceeded(None, {}), NOW)
    folded = fold(transition, step)
    assert folded is not None and folded.of(WithinStepDeadline) == [held]


def test_a_transition_into_a_step_with_a_deadline_does_not_fold() -> None:
    """Its commit schedules the step's deadline, counted from entering the step, before its handler runs: a
    folded one would count it from the handler's end (docs/sagas.md, "Step deadlines")."""
    transition = _timed_signal("rush")
    assert transition.first(ScheduleStepDeadline) is not None
    assert not foldable(transition)
