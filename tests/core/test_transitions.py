"""The transition function's decisions for each command kind, without a database."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest

from stepstone.core.effects import (
    CloseTimers,
    Enqueue,
    IfStopped,
    MovePosition,
    NotifyParent,
    RecordHistory,
    RequeueSignals,
    SetState,
    SettleQueued,
)
from stepstone.core.model import (
    Branch,
    CommandView,
    Decision,
    InstanceView,
    Parent,
    RunStep,
    StepFailed,
    StepSucceeded,
)
from stepstone.core.plan import END, Plan, RetryPolicy, Step
from stepstone.core.redaction import Redaction
from stepstone.core.transitions import advance, apply, reports_wanted
from stepstone.core.transitions import complete_step as core_complete_step
from stepstone.store.effects import commit_document


@dataclass(frozen=True)
class Moved:
    """A decision's position change and state change, read together."""

    status: str
    step: str | None
    visit: int
    wait: object
    error: object
    state: object


class D:
    """A decision read through its typed effects."""

    def __init__(self, decision: Decision) -> None:
        self.decision = decision
        self.settle = decision.settle
        self.ended = decision.ended
        self.continuation = decision.continuation
        self.history = tuple(decision.of(RecordHistory))
        self.commands = tuple(decision.of(Enqueue))
        self.close_timers = bool(decision.of(CloseTimers))
        self.requeue_signals = tuple(n for r in decision.of(RequeueSignals) for n in r.names)
        move, state = decision.first(MovePosition), decision.first(SetState)
        self.instance = None if move is None else Moved(
            move.status, move.step, move.visit, move.wait, move.error, None if state is None else state.state
        )


def complete_step(*args: object) -> D:
    return D(core_complete_step(*args))  # type: ignore[arg-type]

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
PLAN = Plan.build(
    "order", 1, "reserve",
    [
        Step("reserve", "action", ("pause", "give_up"), retry=RetryPolicy(3, 10, 2, 60, ("Fatal",))),
        Step("pause", "timer", ("await_pay",), delay_seconds=300),
        Step("await_pay", "wait", signals={"paid": "ship", "void": END}, timeout_seconds=60, on_timeout="give_up"),
        Step("ship", "action", (END,)),
        Step("give_up", "action", ()),
    ],
)


def inst(status: str = "RUNNING", step: str | None = "reserve", visit: int = 1, **kw: object) -> InstanceView:
    state = kw.pop("state", {"n": 1})
    return InstanceView("i-1", status, step, visit, state, **kw)  # type: ignore[arg-type]


def waiting_at(step: str, visit: int = 3) -> InstanceView:
    s = PLAN.steps[step]
    wait = {"kind": "signal", "signals": dict(s.signals)} if s.kind == "wait" else {"kind": "timer"}
    return inst("WAITING", step, visit, wait=wait)


def decide(instance: InstanceView, command: CommandView, plan: Plan = PLAN, max_claims: int = 5) -> D:
    out = apply(instance, command, plan, NOW, max_claims)
    assert isinstance(out, Decision), out
    return D(out)


def hist(d: D) -> list[str]:
    return [h.kind for h in d.history]


# -- apply ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["START", "STEP", "RETRY"])
def test_step_commands_run_the_current_action(kind: str) -> None:
    assert apply(inst(), CommandView(1, kind, "reserve", 1, attempt=2), PLAN, NOW) == RunStep("reserve", 1, 2)


def test_a_step_command_for_an_older_visit_is_stale() -> None:
    d = decide(inst(visit=2), CommandView(1, "STEP", "reserve", 1))
    assert d.settle.state == "STALE" and d.instance is None and d.history == ()


def test_start_on_a_timer_enters_it_without_a_handler() -> None:
    plan = Plan.build("t", 1, "pause", [Step("pause", "timer", (END,), delay_seconds=5)])
    d = decide(inst("PENDING", "pause"), CommandView(1, "START", "pause", 1), plan)
    assert d.settle.state == "COMPLETE" and d.instance is not None
    assert (d.instance.status, d.instance.step, d.instance.visit) == ("WAITING", "pause", 1)
    [timer] = d.commands
    assert (timer.kind, timer.name, timer.delay, timer.continuation) == ("TIMER", "fire", 5, False)
    assert hist(d) == ["WAITING"]


def test_start_on_a_wait_requeues_its_parked_signals() -> None:
    plan = Plan.build("w", 1, "w", [Step("w", "wait", signals={"b": END, "a": END})])
    d = decide(inst("PENDING", "w"), CommandView(1, "START", "w", 1), plan)
    assert d.requeue_signals == ("a", "b") and d.commands == ()
    assert d.instance is not None and d.instance.wait["signals"] == {"a": END, "b": END}


def test_signal_not_awaited_is_parked() -> None:
    for instance in (inst(), waiting_at("pause")):
        d = decide(instance, CommandView(7, "SIGNAL", name="paid", payload={"x": 1}))
        assert d.settle.state == "PARKED" and d.instance is None
        assert hist(d) == ["SIGNAL_PARKED"] and d.history[0].data == {"signal": "paid"}


def test_accepted_signal_moves_on_and_carries_its_payload() -> None:
    d = decide(waiting_at("await_pay"), CommandView(7, "SIGNAL", name="paid", payload={"amount": 3}))
    assert d.settle.state == "COMPLETE" and d.close_timers
    assert d.instance is not None and (d.instance.status, d.instance.step, d.instance.visit) == ("RUNNING", "ship", 4)
    assert hist(d) == ["SIGNAL_APPLIED"] and d.history[0].data == {"signal": "paid", "command": 7}
    cont = d.continuation
    assert cont is not None and cont.step == "ship" and cont.visit == 4
    assert cont.payload == {"signal": {"name": "paid", "payload": {"amount": 3}}}


def test_signal_straight_to_end_completes() -> None:
    d = decide(waiting_at("await_pay"), CommandView(7, "SIGNAL", name="void"))
    assert d.ended and d.instance is not None and d.instance.status == "COMPLETED"
    assert hist(d) == ["SIGNAL_APPLIED", "INSTANCE_COMPLETED"]


def test_timer_fires_into_the_next_step() -> None:
    d = decide(waiting_at("pause"), CommandView(2, "TIMER", "pause", 3, name="fire"))
    assert d.settle.state == "COMPLETE" and d.close_timers
    assert d.instance is not None and (d.instance.status, d.instance.step) == ("WAITING", "await_pay")
    assert hist(d) == ["TIMER_FIRED", "WAITING"]
    [timeout] = d.commands
    assert (timeout.kind, timeout.name, timeout.delay, timeout.visit) == ("TIMER", "timeout", 60, 4)
    assert d.requeue_signals == ("paid", "void")


def test_wait_timeout_takes_the_timeout_transition() -> None:
    d = decide(waiting_at("await_pay"), CommandView(2, "TIMER", "await_pay", 3, name="timeout"))
    assert hist(d) == ["WAIT_TIMED_OUT"]
    assert d.instance is not None and d.instance.step == "give_up"


@pytest.mark.parametrize("instance", [waiting_at("pause", visit=4), inst("RUNNING", "pause", 3)])
def test_timer_of_another_visit_or_status_is_stale(instance: InstanceView) -> None:
    d = decide(instance, CommandView(2, "TIMER", "pause", 3, name="fire"))
    assert d.settle.state == "STALE" and d.instance is None


@pytest.mark.parametrize(("status", "kind", "settle"), [
    ("COMPLETED", "SIGNAL", "REJECTED"), ("CANCELLED", "STEP", "REJECTED"), ("COMPLETED", "TIMER", "STALE"),
])
def test_ended_instances_take_no_commands(status: str, kind: str, settle: str) -> None:
    d = decide(inst(status, None), CommandView(1, kind, name="paid"))
    assert d.settle.state == settle and d.instance is None


def test_too_many_claims_dead_letters_the_command_and_fails_the_instance() -> None:
    d = decide(inst(), CommandView(1, "START", "reserve", 1, claims=5, alone_claims=3), max_claims=3)
    assert d.settle.state == "DEAD"
    assert d.instance is not None and d.instance.status == "FAILED" and d.instance.error["type"] == "DeadLetter"
    assert hist(d) == ["COMMAND_DEAD_LETTERED", "INSTANCE_FAILED"]
    assert apply(inst(), CommandView(1, "START", "reserve", 1, claims=4, alone_claims=2), PLAN, NOW, 3) == RunStep(
        "reserve", 1, 1)
    # Claims beside other commands (of a worker whose process died with them) count for nothing.
    assert apply(inst(), CommandView(1, "START", "reserve", 1, claims=9), PLAN, NOW, 3) == RunStep("reserve", 1, 1)


def test_a_poison_signal_is_dead_lettered_alone() -> None:
    d = decide(waiting_at("await_pay"), CommandView(1, "SIGNAL", name="paid", claims=7, alone_claims=5))
    assert d.settle.state == "DEAD" and d.instance is None and hist(d) == ["COMMAND_DEAD_LETTERED"]


def test_unknown_command_kind_is_rejected() -> None:
    assert decide(inst(), CommandView(1, "MIGRATION")).settle.state == "REJECTED"


def test_until_timer_uses_the_state_instant_and_fails_on_a_bad_one() -> None:
    plan = Plan.build("u", 1, "go", [
        Step("go", "action", ("deadline",)),
        Step("deadline", "timer", (END,), until="ship_by"),
    ])
    later = (NOW + timedelta(hours=1)).isoformat()
    past = ((NOW - timedelta(days=1)).isoformat(), "0001-01-01T00:00:00+00:01")  # the second: year 0 in UTC
    for value, expected in ((later, later), *((p, NOW.isoformat()) for p in past)):
        d = complete_step(inst(step="go"), CommandView(1, "START"), plan, StepSucceeded(None, {"ship_by": value}), NOW)
        [timer] = d.commands
        assert timer.at == expected and d.instance is not None and d.instance.status == "WAITING"
    # The last: year 10000 in UTC. PostgreSQL stored such a timer, and then the driver could read neither
    # it nor its instance (OverflowError in `Client.get`).
    for bad in ("tomorrow", "2030-01-01T00:00:00", 17, "9999-12-31T23:59:00-01:00"):
        d = complete_step(inst(step="go"), CommandView(1, "START"), plan, StepSucceeded(None, {"ship_by": bad}), NOW)
        # The step itself completed; entering the timer is what fails the instance.
        assert hist(d) == ["STEP_COMPLETED", "INSTANCE_FAILED"] and d.commands == ()
        assert d.instance is not None and d.instance.status == "FAILED"
        assert d.instance.error["type"] == "InvalidTimer" and d.instance.step == "deadline"
        # The command's settlement says what happened (issue: it was COMPLETE while the instance failed).
        assert d.settle.state == "FAILED" and (d.settle.reason or "").startswith("InvalidTimer: ")


# -- complete_step -------------------------------------------------------------------------------------


def test_success_records_the_patch_and_enters_the_chosen_step() -> None:
    d = complete_step(inst(), CommandView(1, "START", attempt=2), PLAN, StepSucceeded("pause", {"n": 2}), NOW)
    assert d.settle.state == "COMPLETE"
    assert hist(d) == ["STEP_COMPLETED", "WAITING"]
    assert d.history[0].data == {"attempt": 2, "patch": [{"op": "replace", "path": "/n", "value": 2}]}
    assert d.instance is not None and d.instance.state == {"n": 2} and d.instance.visit == 2


def test_success_into_an_action_continues_on_the_same_worker() -> None:
    instance = waiting_at("await_pay")
    ship = InstanceView("i-1", "RUNNING", "ship", 4, instance.state)
    d = complete_step(ship, CommandView(2, "STEP", "ship", 4), PLAN, StepSucceeded(None, instance.state), NOW)
    assert d.ended and d.instance is not None and d.instance.status == "COMPLETED" and d.instance.state is None
    d = complete_step(inst(), CommandView(1, "START"), PLAN, StepSucceeded("give_up", {"n": 1}), NOW)
    cont = d.continuation
    assert cont is not None and cont.kind == "STEP" and cont.step == "give_up" and cont.visit == 2
    assert advance(inst(), d.decision, 0) == InstanceView(
        "i-1", "RUNNING", "give_up", 2, {"n": 1}, None, position_status="RUNNING"
    )


def test_a_step_with_no_next_ends_the_instance() -> None:
    d = complete_step(inst(step="give_up"), CommandView(1, "STEP"), PLAN, StepSucceeded(None, {"n": 1}), NOW)
    assert d.ended and hist(d) == ["STEP_COMPLETED", "INSTANCE_COMPLETED"]


@pytest.mark.parametrize("target", ["ship", None, "nowhere"])
def test_an_undeclared_transition_fails_without_retry(target: str | None) -> None:
    # reserve has two possible next steps, so None is ambiguous too.
    d = complete_step(inst(), CommandView(1, "START"), PLAN, StepSucceeded(target, {"n": 1}), NOW)
    assert d.settle.state == "FAILED"
    assert d.instance is not None and d.instance.error["type"] == "InvalidTransition"


def test_failure_is_retried_with_backoff_until_attempts_run_out() -> None:
    failed = StepFailed("Flaky", "busy")
    for attempt, delay in ((1, 10.0), (2, 20.0)):
        d = complete_step(inst(), CommandView(1, "START", attempt=attempt), PLAN, failed, NOW)
        assert d.settle.state == "RETRY" and d.settle.retry_delay == delay and d.instance is None
        assert hist(d) == ["STEP_FAILED"] and d.history[0].data["retry_in"] == delay
    d = complete_step(inst(), CommandView(1, "START", attempt=3), PLAN, failed, NOW)
    assert d.settle.state == "FAILED" and hist(d) == ["STEP_FAILED", "INSTANCE_FAILED"]
    assert d.instance is not None and d.instance.error == {
        "step": "reserve", "type": "Flaky", "message": "busy", "attempt": 3,
    }


@pytest.mark.parametrize("failed", [StepFailed("Fatal", "no"), StepFailed("Flaky", "no", retryable=False)])
def test_non_retryable_failures_fail_at_once(failed: StepFailed) -> None:
    d = complete_step(inst(), CommandView(1, "START", attempt=1), PLAN, failed, NOW)
    assert d.settle.state == "FAILED" and d.instance is not None and d.instance.status == "FAILED"


def test_a_change_python_equality_misses_is_still_stored() -> None:
    # [False] == [0] in Python, but they are different JSON documents.
    before = inst(state={"flags": [False]})
    d = complete_step(before, CommandView(1, "START"), PLAN, StepSucceeded("give_up", {"flags": [0]}), NOW)
    assert d.instance is not None and d.instance.state == {"flags": [0]}
    assert d.history[0].data["patch"] == [{"op": "replace", "path": "/flags", "value": [0]}]


# -- joins: the branch reports queued behind the claimed one (migration 0037) ---------------------------

MAP = Plan.build("m", 1, "spread", [
    Step("spread", "fork", map_over="items", branch_step="work"),
    Step("work", "action", ("gather",)),
    Step("gather", "join", ("done",), fork="spread"),
    Step("done", "action", (END,)),
])


def at_join(done: int, need: int, total: int = 10) -> InstanceView:
    wait = {"kind": "join", "fork": "spread", "join": "gather", "total": total, "need": need, "done": done}
    return inst("WAITING", "spread", 1, wait=wait)


def report(n: int, *, visit: int = 1, behind: tuple[CommandView, ...] = ()) -> CommandView:
    return CommandView(100 + n, "BRANCH_DONE", "spread", visit, payload={"fork": "spread", "branch": f"spread/{n}"},
                       behind=behind)


def joined(d: D) -> list[tuple[object, object]]:
    return [(h.data["branch"], h.data["done"]) for h in d.history if h.kind == "BRANCH_JOINED"]


def test_a_report_alone_joins_one_branch_and_waits_on() -> None:
    d = decide(at_join(2, 10), report(0), MAP)
    assert joined(d) == [("spread/0", 3)] and not d.decision.of(SettleQueued)
    assert d.instance is not None and d.instance.status == "WAITING" and d.instance.wait["done"] == 3


def test_the_reports_queued_behind_join_in_the_same_commit_in_queue_order() -> None:
    d = decide(at_join(0, 10), report(0, behind=(report(1), report(2), report(3))), MAP)
    assert joined(d) == [("spread/0", 1), ("spread/1", 2), ("spread/2", 3), ("spread/3", 4)]
    assert [e.command_ids for e in d.decision.of(SettleQueued)] == [(101, 102, 103)]
    assert d.instance is not None and d.instance.wait["done"] == 4 and d.settle.state == "COMPLETE"


def test_a_join_takes_no_more_reports_than_it_needs_and_fires_once() -> None:
    d = decide(at_join(1, 3), report(0, behind=tuple(report(n) for n in range(1, 6))), MAP)
    assert joined(d) == [("spread/0", 2), ("spread/1", 3)]
    assert [e.command_ids for e in d.decision.of(SettleQueued)] == [(101,)]  # the other four stay queued
    assert hist(d).count("JOINED") == 1 and d.continuation is not None and d.continuation.step == "done"


def test_no_report_overtakes_a_command_queued_before_it() -> None:
    signal = CommandView(150, "SIGNAL", None, 1, "poke")
    d = decide(at_join(0, 10), report(0, behind=(report(1), signal, report(2))), MAP)
    assert joined(d) == [("spread/0", 1), ("spread/1", 2)]
    stale = decide(at_join(0, 10), report(0, behind=(report(1, visit=2), report(2))), MAP)
    assert joined(stale) == [("spread/0", 1)] and not stale.decision.of(SettleQueued)


def test_the_reports_a_join_could_take_behind_the_claimed_one() -> None:
    assert reports_wanted(at_join(2, 10), report(0)) == 7
    assert reports_wanted(at_join(9, 10), report(0)) == 0  # this report completes the join: no look behind it
    assert reports_wanted(at_join(2, 10), report(0, visit=2)) == 0  # not a report this join waits for
    assert reports_wanted(inst("WAITING", "spread", 1, wait={"kind": "signal"}), report(0)) == 0


# -- a branch that fails for good ----------------------------------------------------------------------


def _branch(**kw: object) -> InstanceView:
    return inst(position="f/a", branch=Branch("", 2, "a"), **kw)


def test_a_branch_failing_for_good_leaves_whether_the_instance_fails_to_its_commit() -> None:
    child = _branch(parent=Parent("p-1", "", 4))
    d = complete_step(child, CommandView(1, "STEP", "reserve", 1, attempt=3), PLAN, StepFailed("Flaky", "busy"), NOW)
    assert d.settle.state == "FAILED" and d.instance is not None and d.instance.status == "FAILED"
    assert hist(d) == ["STEP_FAILED"]  # INSTANCE_FAILED or BRANCH_FAILED: as the join's count says
    [branch] = d.decision.of(IfStopped)
    [stopped, told] = branch.stopped
    assert isinstance(stopped, RecordHistory) and stopped.kind == "INSTANCE_FAILED"
    assert isinstance(told, NotifyParent) and told.payload["status"] == "FAILED"  # the parent hears only then
    assert [(type(e), getattr(e, "kind", None)) for e in branch.passed] == [(RecordHistory, "BRANCH_FAILED")]
    assert not d.decision.of(NotifyParent)

    doc = commit_document(d.decision, instance_id="i-1", position="f/a", command_id=1, token=uuid.UUID(int=1), visit=1,
                          state_version=1, version=1, lease_seconds=30, worker="w")
    assert [h["kind"] for h in doc["history"]] == ["STEP_FAILED"] and "notify" not in doc
    assert [h["kind"] for h in doc["if_stopped"]["stopped"]["history"]] == ["INSTANCE_FAILED"]
    assert doc["if_stopped"]["stopped"]["notify"][0]["parent_id"] == "p-1"
    assert doc["if_stopped"]["passed"] == {"history": [{"kind": "BRANCH_FAILED", "step": "reserve", "visit": 1,
                                                        "data": stopped.data}]}


def test_a_dead_lettered_branch_leaves_it_to_its_commit_too() -> None:
    d = decide(_branch(), CommandView(1, "STEP", "reserve", 1, claims=7, alone_claims=5))
    assert d.settle.state == "DEAD" and hist(d) == ["COMMAND_DEAD_LETTERED"]
    [branch] = d.decision.of(IfStopped)
    assert [e.kind for e in branch.stopped if isinstance(e, RecordHistory)] == ["INSTANCE_FAILED"]


def test_a_root_failure_fails_the_instance_outright() -> None:
    d = complete_step(inst(), CommandView(1, "START", attempt=1), PLAN, StepFailed("Fatal", "no"), NOW)
    assert hist(d) == ["STEP_FAILED", "INSTANCE_FAILED"] and not d.decision.of(IfStopped)


def test_redaction_reaches_both_outcomes_of_a_branch_failure() -> None:
    state = {"card": "4111-1111"}
    d = complete_step(_branch(state=state), CommandView(1, "STEP", "reserve", 1, attempt=3), PLAN,
                      StepFailed("Fatal", "card 4111-1111 refused"), NOW)
    redacted = Redaction(paths=(("card",),)).decision(d.decision, state)
    [branch] = redacted.of(IfStopped)
    for entry in (*branch.stopped, *branch.passed):
        assert isinstance(entry, RecordHistory) and "4111" not in entry.data["message"], entry
