"""The core of tasks and messages, pure: plan rules, opening a task, completions and timers."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from stepstone.authoring.workflow import Workflow
from stepstone.core.effects import ChangeTask, CloseTimers, Enqueue, MovePosition, OpenTask, Subscribe
from stepstone.core.model import CommandView, Decision, InstanceView
from stepstone.core.plan import Plan, PlanError, Step
from stepstone.core.task_spec import TaskSpec, resolve_instant, task_id
from stepstone.core.transitions import apply
from stepstone.errors import DefinitionError

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _plan() -> Plan:
    spec = TaskSpec(title="Approve {who}", assignee={"state": "boss"}, candidate_groups=("g",), show=("amount",),
                    reminder_seconds=60, due=3600, escalate_group="leads", expire_seconds=7200, on_expire="late")
    return Plan.build("p", 1, "start", [
        Step("start", "action", ("t",)),
        Step("t", "task", decisions={"yes": "done", "no": "done"}, task=spec),
        Step("done", "action", ("w",)),
        Step("w", "wait", messages={"m": "late"}, correlation="ref.id"),
        Step("late", "action", ()),
    ])


def _decide(instance: InstanceView, command: CommandView, plan: Plan) -> Decision:
    decision = apply(instance, command, plan, NOW)
    assert isinstance(decision, Decision)
    return decision


def _at(step: str, visit: int, wait: object, state: object = None) -> InstanceView:
    return InstanceView("00000000-0000-0000-0000-000000000001", "WAITING", step, visit,
                        state if state is not None else {"amount": 5, "boss": "bo", "who": "eve", "ref": {"id": 7}},
                        wait, position_status="WAITING")


def test_plan_rules() -> None:
    with pytest.raises(PlanError, match="at least one decision"):
        Plan.build("p", 1, "t", [Step("t", "task", task=TaskSpec(title="x"))])
    with pytest.raises(PlanError, match="names no correlation"):
        Plan.build("p", 1, "w", [Step("w", "wait", messages={"m": "a"}), Step("a", "action")])
    with pytest.raises(PlanError, match="expire and on_expire"):
        Plan.build("p", 1, "t", [Step("t", "task", decisions={"ok": "a"}, task=TaskSpec(title="x", expire_seconds=1)),
                                 Step("a", "action")])
    assert "messages" not in Step("w", "wait", signals={"s": "a"}).describe()  # old plan hashes stay as they were
    for priority in (2**31, -(2**31) - 1, "high", True):  # what no task row holds: refused with the definition
        with pytest.raises(PlanError, match="priority must be a whole number"):
            Plan.build("p", 1, "t", [Step("t", "task", decisions={"ok": "a"},
                                          task=TaskSpec(title="x", priority=priority)), Step("a", "action")])


def test_a_literal_name_no_user_can_have_is_refused_with_the_definition() -> None:
    """A task escalated to " finance-leads" (a pasted name) went to a group no token can be in, and a literal
    assignee "ann\n" failed every instance at the task: both are refused when the workflow is defined."""
    for field, value in (("assignee", " ann"), ("owner", "ann\n"), ("candidate_users", ("ann", "bob ")),
                         ("candidate_groups", ("fin\tance",)), ("escalate_user", "lee "),
                         ("escalate_group", " finance-leads")):
        with pytest.raises(PlanError, match=f"{field}.*(spaces around it|control character)"):
            Plan.build("p", 1, "t", [Step("t", "task", decisions={"ok": "a"},
                                          task=TaskSpec(title="x", **{field: value})), Step("a", "action")])
    Plan.build("p", 1, "t", [Step("t", "task", decisions={"ok": "a"},
                                  task=TaskSpec(title="x", assignee="ann smith", escalate_group="finance leads")),
                             Step("a", "action")])


def test_entering_a_task_opens_it_with_its_timers() -> None:
    plan = _plan()
    start = InstanceView("00000000-0000-0000-0000-000000000001", "RUNNING", "start", 1,
                         {"amount": 5, "boss": "bo", "who": "eve", "secret": "s"}, position_status="RUNNING")
    from stepstone.core.entering import enter  # noqa: PLC0415

    effects = enter(start, plan, "t", start.state, NOW)
    [opened] = [e for e in effects if isinstance(e, OpenTask)]
    assert opened.task["id"] == task_id(start.id, "", "t", 2)
    assert (opened.task["title"], opened.task["assignee"], opened.task["data"]) == ("Approve eve", "bo", {"amount": 5})
    assert sorted(e.name or "" for e in effects if isinstance(e, Enqueue)) == ["due", "expire", "remind"]
    move = next(e for e in effects if isinstance(e, MovePosition))
    assert move.wait == {"kind": "task", "task_id": opened.task["id"], "decisions": {"yes": "done", "no": "done"}}


def test_a_completion_moves_on_or_reopens_the_task() -> None:
    plan = _plan()
    tid = task_id("00000000-0000-0000-0000-000000000001", "", "t", 2)
    wait = {"kind": "task", "task_id": tid, "decisions": {"yes": "done", "no": "done"}}
    body = {"task_id": tid, "decision": "yes", "payload": None, "actor": "bo"}
    done = _decide(_at("t", 2, wait), CommandView(5, "TASK_COMPLETION", "t", 2, "yes", body), plan)
    assert done.settle.state == "COMPLETE"
    assert ChangeTask(tid, "complete", {"decision": "yes", "actor": "bo"}) in done.effects
    assert any(isinstance(e, CloseTimers) for e in done.effects)
    stale = _decide(_at("t", 3, wait), CommandView(5, "TASK_COMPLETION", "t", 2, "yes", body), plan)
    assert stale.settle.state == "REJECTED"
    assert ChangeTask(tid, "reopen", {"reason": "TASK_NOT_CURRENT"}) in stale.effects


def test_task_timers() -> None:
    plan = _plan()
    tid = task_id("00000000-0000-0000-0000-000000000001", "", "t", 2)
    wait = {"kind": "task", "task_id": tid, "decisions": {"yes": "done", "no": "done"}}
    due = _decide(_at("t", 2, wait), CommandView(6, "TIMER", "t", 2, "due"), plan)
    assert ChangeTask(tid, "escalate", {"user": None, "group": "leads"}) in due.effects
    assert not any(isinstance(e, MovePosition) for e in due.effects)
    expired = _decide(_at("t", 2, wait), CommandView(7, "TIMER", "t", 2, "expire"), plan)
    assert ChangeTask(tid, "expire") in expired.effects
    old = _decide(_at("t", 3, wait), CommandView(8, "TIMER", "t", 2, "remind"), plan)
    assert old.settle.state == "STALE"


def test_a_wait_subscribes_with_its_key_and_takes_one_message() -> None:
    plan = _plan()
    at_done = InstanceView("00000000-0000-0000-0000-000000000001", "RUNNING", "done", 3, {"ref": {"id": 7}},
                           position_status="RUNNING")
    from stepstone.core.entering import enter  # noqa: PLC0415

    assert Subscribe(("m",), "7", 4) in enter(at_done, plan, "w", at_done.state, NOW)
    wait = {"kind": "signal", "signals": {}, "messages": {"m": "late"}}
    taken = _decide(_at("w", 4, wait), CommandView(9, "MESSAGE", "w", 4, "m", {"payload": 1}), plan)
    assert taken.settle.state == "COMPLETE"
    parked = _decide(_at("w", 5, wait), CommandView(9, "MESSAGE", "w", 4, "m", {"payload": 1}), plan)
    assert parked.settle.state == "PARKED"


def test_a_wait_whose_key_is_empty_or_missing_subscribes_to_nothing_and_says_so() -> None:
    """An empty text subscribed with the key "", which no publish can give (an empty correlation key is
    refused): the wait could never take a message, and nothing said why."""
    from stepstone.core.effects import RecordHistory  # noqa: PLC0415
    from stepstone.core.entering import enter  # noqa: PLC0415

    plan = _plan()
    for state in ({"ref": {"id": ""}}, {"ref": {}}):
        at_done = InstanceView("00000000-0000-0000-0000-000000000001", "RUNNING", "done", 3, state,
                               position_status="RUNNING")
        effects = enter(at_done, plan, "w", at_done.state, NOW)
        assert not [e for e in effects if isinstance(e, Subscribe)], state
        assert RecordHistory("NO_CORRELATION_KEY", "w", 4, {"field": "ref.id"}) in effects, state


def test_a_due_date_from_the_state_that_no_timestamp_holds_is_no_due_date() -> None:
    """Outside years 1 to 9999 in UTC the driver reads no timestamp (a timer's `until` that far out left
    its instance unreadable), and seconds that far out are no instant at all."""
    assert resolve_instant({"state": "due"}, {"due": 3600}, NOW) == "2026-01-01T01:00:00+00:00"
    assert resolve_instant({"state": "due"}, {"due": -60}, NOW) == "2025-12-31T23:59:00+00:00"
    for value in (1e300, float("inf"), float("nan"), "0001-01-01T00:00:00+00:01", "9999-12-31T23:59:00-01:00"):
        assert resolve_instant({"state": "due"}, {"due": value}, NOW) is None, value


@pytest.mark.parametrize(("field", "named"), [("due", "due"), ("follow_up", "follow_up"),
                                             ("reminder_seconds", "reminder"), ("expire_seconds", "expire")])
def test_every_task_date_written_as_seconds_is_at_most_a_thousand_years(field: str, named: str) -> None:
    """A due date or follow-up past a thousand years was taken, then dropped when the task opened
    (due_at null), while a reminder or an expiry that long was refused. Each is named as `Workflow.task`
    and a document take it."""
    extra = {"on_expire": "a"} if field == "expire_seconds" else {}
    spec = TaskSpec(title="x", **{field: 4e10}, **extra)  # type: ignore[arg-type]
    expected = f"task step 't': {named} must be at most a thousand years, got 40000000000.0 s"
    with pytest.raises(PlanError, match=expected):
        Plan.build("p", 1, "t", [Step("t", "task", decisions={"ok": "a"}, task=spec), Step("a", "action")])


def test_a_python_task_with_a_due_date_past_a_thousand_years_is_a_definition_error() -> None:
    wf = Workflow("x")
    wf.task("t", title="T", decisions={"ok": "$end"}, start=True, due=timedelta(days=366_000))
    with pytest.raises(DefinitionError, match="task step 't': due must be at most a thousand years"):
        wf.plan  # noqa: B018
