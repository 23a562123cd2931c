"""One commit for a transition and the step it enters.

A signal, a timer, a message or a child's end moves a waiting position to its next step without a
handler: a decision whose only continuation is that step. Committed on its own, it costs a round trip
(with its WAL flush) before the step's handler may start, and the step's own commit follows: two
commits per signal. Instead the worker runs the entered step at once and commits both decisions as
one (`fold`), under the command that was claimed (the signal settles, the step's history follows the
transition's in the same commit). Measured on the idle signal -> next step path (docs/performance-history.md,
"Signal -> next step on an idle worker"): the transition's commit was 1.4 ms of 3.55 ms at p50.

Only a plain transition folds (`foldable`): history, closed timers, the move, the continuation, the
join reports settled with the claimed one (`SettleQueued`) and the deadline of the wait it leaves
(`WithinStepDeadline`, held at the commit), no state change and nothing else, so the
folded commit writes exactly what the two commits would have, save the continuation command between
them. Only a step that completes folds into it: a step that fails or retries settles its own command
(RETRY puts that command back), so the worker commits the transition first and then the step, as
before, without running the handler again.
"""

from __future__ import annotations

from stepstone.core.effects import (
    CloseTimers,
    Effect,
    Enqueue,
    MovePosition,
    RecordHistory,
    SettleQueued,
    WithinStepDeadline,
)
from stepstone.core.model import Decision

__all__ = ["fold", "foldable"]

# WithinStepDeadline: a signal leaving a wait that has a deadline folds too; the commit holds the wait's deadline
# (migration 0061). A transition into a step that has a deadline does not fold: its ScheduleStepDeadline is not
# plain, so the transition commits first and the deadline counts from entering the step, not from the end of
# its handler (docs/sagas.md, "Step deadlines").
_PLAIN = (RecordHistory, CloseTimers, MovePosition, Enqueue, SettleQueued, WithinStepDeadline)


def foldable(transition: Decision) -> bool:
    """A plain transition into a step that continues in the same segment. Asked only of a decision no
    handler ran for: a step's completion may look as plain (a step that changed nothing), but it
    commits before the next step runs, so a crash repeats at most the step in flight."""
    return (
        transition.settle.state == "COMPLETE"
        and transition.continuation is not None
        and all(isinstance(e, _PLAIN) for e in transition.effects)
        and sum(isinstance(e, Enqueue) for e in transition.effects) == 1  # the continuation alone
    )


def fold(transition: Decision, step: Decision) -> Decision | None:
    """The transition and the step it entered as one decision settling the transition's command, or
    None when the step does not complete (its own command must carry the retry or the failure).

    The transition's move and continuation give way to the step's: the commit keeps one move (the
    position's place after both) and one continuation (the step's, if it goes on to another)."""
    if step.settle.state != "COMPLETE" or step.first(MovePosition) is None:
        return None
    kept: list[Effect] = [e for e in transition.effects if not isinstance(e, MovePosition | Enqueue)]
    return Decision(transition.settle, (*kept, *step.effects))
