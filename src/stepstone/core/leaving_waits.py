"""Leaving a wait or timer step that has a deadline: the commit holds the deadline, as a handler's does.

A signal, message or timer that leaves such a step is applied by its own commit, without a handler. When
the step's deadline has passed by then while its timer has not fired (no slot was free to claim it, or a
worker that died holds it), or has fired and its TIMER still waits on this position behind the command,
the deadline wins: the store interrupts the step (or leaves that to the timer's worker) and settles the
command as the wait's leaving would have (`WithinStepDeadline`, migration 0061).
"""

from __future__ import annotations

from stepstone.core.effects import RecordHistory, WithinStepDeadline
from stepstone.core.model import Decision, InstanceView, Settle
from stepstone.core.plan import Plan

LATE = "STEP_DEADLINE_PASSED"
"""The reason a command that came after its wait's deadline is settled with."""


def within_deadline(instance: InstanceView, plan: Plan, decision: Decision, late: Settle,
                    *late_history: RecordHistory) -> Decision:
    """`decision`, which leaves the position's current step, and when that step has a deadline, what the
    commit does with the claimed command if the deadline has won (`late`, with `late_history`)."""
    step = plan.steps.get(instance.step or "")
    if step is None or step.deadline_seconds is None:
        return decision
    held = WithinStepDeadline(step.name, instance.visit, late.state, late.reason, late_history)
    return Decision(decision.settle, (*decision.effects, held))
