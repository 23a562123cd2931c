"""A step deadline timer on a plan that does not back it (the step has no deadline there, or no such step:
the instance was moved to that plan by a migration made before such moves were refused): moot, never a
crash of the segment."""

from __future__ import annotations

from stepstone.core.effects import InterruptStep, MovePosition, RecordHistory
from stepstone.core.model import CommandView, Decision, InstanceView
from stepstone.core.saga import SAGA, STEP_DEADLINE
from stepstone.core.transitions import apply
from tests.core.test_transitions import NOW, PLAN, inst, waiting_at


def _decide(instance: InstanceView, command: CommandView) -> Decision:
    out = apply(instance, command, PLAN, NOW, 5)
    assert isinstance(out, Decision), out
    return out


def _on_saga(step: str) -> Decision:
    at_saga = inst("RUNNING", None, 1, position=SAGA, position_status="SAGA")
    payload = {"step": step, "visit": 3, "position": ""}
    return _decide(at_saga, CommandView(9, "TIMER", step, 3, STEP_DEADLINE, payload))


def test_a_deadline_timer_on_saga_for_a_step_without_a_deadline_is_moot() -> None:
    for step, why in (("await_pay", "v1 has no step deadline"), ("gone", "v1 has no such step")):
        decision = _on_saga(step)
        assert (decision.settle.state, decision.settle.reason) == ("STALE", "STEP_DEADLINE_MOOT")
        assert not decision.of(InterruptStep)
        [moot] = decision.of(RecordHistory)
        assert (moot.kind, moot.step, moot.visit, moot.data) == (
            "STEP_DEADLINE_MOOT", step, 3, {"position": "", "version": 1, "reason": why})


def test_a_wait_interrupted_under_an_earlier_plan_goes_on_waiting() -> None:
    decision = _decide(waiting_at("await_pay"), CommandView(9, "TIMER", "await_pay", 3, STEP_DEADLINE))
    assert (decision.settle.state, decision.settle.reason) == ("STALE", "STEP_DEADLINE_MOOT")
    assert not decision.of(MovePosition)


def test_an_action_interrupted_under_an_earlier_plan_fails_its_step() -> None:
    """Its step command was settled by the interrupt: nothing would run it on, so it fails (an operator's
    retry runs it again under its plan), where formatting the missing deadline raised TypeError."""
    decision = _decide(inst("RUNNING", "reserve", 1), CommandView(9, "TIMER", "reserve", 1, STEP_DEADLINE))
    [moved] = decision.of(MovePosition)
    assert moved.status == "FAILED"
    assert moved.error is not None and "did not finish within its deadline" in str(moved.error)
