"""From a decision's typed effects to the document `commit_decision` carries out.

This is the one place that maps each effect type to its SQL: every effect type
has a writer here that fills one section of the commit document, and each
section has one block of `commit_decision` (or a function it calls, named in
`SECTION_SQL`), run in the lock order written at the head of that function. A
test walks every effect type and fails when one has no writer or its section no
SQL. The whole document goes to the database in one statement.

A feature added after the core does not edit `commit_decision`: its writer calls
`doc.extend(section, item)`, its migration creates one function for the section
and registers it in `effect_sections` (migration 0005 says how), and its
`SECTION_SQL` entry is `feature_section(section)`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from stepstone.core.effects import (
    AdvanceSaga,
    ChangeTask,
    CloseBranches,
    CloseTimers,
    Effect,
    EmitEvent,
    EndInstance,
    Enqueue,
    IfStopped,
    InterruptStep,
    MovePosition,
    NotifyParent,
    OpenBranches,
    OpenExternalTask,
    OpenTask,
    RecordCompensable,
    RecordHistory,
    RedactClaimedPayload,
    RequeueSignals,
    ScheduleStepDeadline,
    SetState,
    SettleQueued,
    StartChild,
    Subscribe,
    WithinStepDeadline,
)
from stepstone.core.model import ROOT, Decision

_EVENTS = uuid.UUID("5f1e0b8a-3c1d-4f0e-9a57-2b8f6c1d9e40")


def event_id(instance_id: str, visit: int, index: int, position: str = ROOT) -> str:
    """Stable id of the index-th event a step visit emitted: the broker's dedup id."""
    where = f"{instance_id}/{visit}" if position == ROOT else f"{instance_id}/{position}/{visit}"
    return str(uuid.uuid5(_EVENTS, f"{where}/{index}"))


class _Doc:
    """The commit document being built for one decision."""

    def __init__(self, instance_id: str, position: str, visit: int) -> None:
        self.instance_id = instance_id
        self.position = position
        self.visit = visit
        self.body: dict[str, Any] = {}  # only the sections the decision uses: less to encode and parse

    def append(self, section: str, item: Any) -> None:
        self.body.setdefault(section, []).append(item)

    def extend(self, section: str, item: Any) -> None:
        """An item of a feature's section, carried out by the function `effect_sections` names."""
        self.body.setdefault("ext", {}).setdefault(section, []).append(item)


FEATURE_SECTION = "effect_sections:"


def feature_section(section: str) -> str:
    """The `SECTION_SQL` entry of an effect whose section a registered function carries out."""
    return FEATURE_SECTION + section


def _move(e: MovePosition, doc: _Doc) -> None:
    doc.body["move"] = {"status": e.status, "step": e.step, "visit": e.visit, "wait": e.wait, "error": e.error}


def _state(e: SetState, doc: _Doc) -> None:
    doc.body["state"] = e.state
    doc.body["changes"] = list(e.changes)


def _history(e: RecordHistory, doc: _Doc) -> None:
    doc.append("history", {"kind": e.kind, "step": e.step, "visit": e.visit, "data": e.data})


def _enqueue(e: Enqueue, doc: _Doc) -> None:
    command = {
        "kind": e.kind, "step": e.step, "visit": e.visit, "name": e.name, "payload": e.payload,
        "delay": e.delay, "at": e.at, "continuation": e.continuation, "position": e.position,
    }
    if e.continuation:  # its own key: the commit may carry it out in the claimed command's row
        doc.body["next"] = command
    else:
        doc.append("commands", command)


def _close_timers(_: CloseTimers, doc: _Doc) -> None:
    doc.body["close_timers"] = True


def _requeue(e: RequeueSignals, doc: _Doc) -> None:
    doc.body.setdefault("requeue", []).extend(e.names)


def _open(e: OpenBranches, doc: _Doc) -> None:
    doc.body["open"] = {
        "visit": e.visit,
        "branches": [{"path": b.path, "step": b.step, "name": b.name, "item": b.item} for b in e.branches],
    }


def _close(e: CloseBranches, doc: _Doc) -> None:
    doc.append("close", {"prefix": e.prefix, "reason": e.reason})


def _end(e: EndInstance, doc: _Doc) -> None:
    doc.body["end"] = {"status": e.status}


def _event(e: EmitEvent, doc: _Doc) -> None:
    doc.append("events", {
        "event_id": event_id(doc.instance_id, doc.visit, e.index, doc.position),
        "type": e.type, "key": e.key, "payload": e.payload,
    })


def _child(e: StartChild, doc: _Doc) -> None:
    doc.append("children", {
        "id": e.id, "definition_id": e.definition_id, "version": e.version, "plan_hash": e.plan_hash,
        "state": e.state, "step": e.step, "cancel_with_parent": e.cancel_with_parent,
        "deadline_seconds": e.deadline_seconds, "start_deadline_seconds": e.start_deadline_seconds,
    })


def _notify(e: NotifyParent, doc: _Doc) -> None:
    doc.append("notify", {"parent_id": e.parent_id, "position": e.position, "visit": e.visit,
                               "payload": e.payload})


def _if_stopped(e: IfStopped, doc: _Doc) -> None:
    # Both sides written: the commit picks one by counting the branch's siblings (migration 0046).
    sides: dict[str, Any] = {}
    for side, effects in (("stopped", e.stopped), ("passed", e.passed)):
        part = _Doc(doc.instance_id, doc.position, doc.visit)
        for effect in effects:
            WRITERS[type(effect)](effect, part)
        sides[side] = part.body
    doc.body["if_stopped"] = sides


def _redact_payload(e: RedactClaimedPayload, doc: _Doc) -> None:
    doc.extend("redacted_payloads", {"payload": e.payload, "task_id": e.task_id, "task_payload": e.task_payload})


def _external_task(e: OpenExternalTask, doc: _Doc) -> None:
    doc.extend("external_tasks", {"task_id": e.task_id, "topic": e.topic, "step": e.step, "visit": e.visit,
                                  "payload": e.payload, "retries": e.retries, "backoff": e.backoff})


def _compensable(e: RecordCompensable, doc: _Doc) -> None:
    doc.extend("compensable", {"step": e.step, "visit": e.visit, "recorded": e.recorded})


def _saga(e: AdvanceSaga, doc: _Doc) -> None:
    doc.extend("saga", {"op": e.op, "cause": e.cause, "record": e.record, "attempts": e.attempts,
                        "error": e.error, "child": e.child})


def _step_deadline(e: ScheduleStepDeadline, doc: _Doc) -> None:
    item: dict[str, Any] = {"step": e.step, "visit": e.visit, "seconds": e.seconds}
    if e.position is not None:  # a branch this commit opens (migration 0047), not the committing position
        item["position"] = e.position
    doc.extend("step_deadlines", item)


def _interrupt(e: InterruptStep, doc: _Doc) -> None:
    doc.extend("interrupts", {"position": e.position, "step": e.step, "visit": e.visit})


def _within_deadline(e: WithinStepDeadline, doc: _Doc) -> None:
    within: dict[str, Any] = {"step": e.step, "visit": e.visit}
    if e.late_settle is not None:  # a command leaving a wait or timer (migration 0061)
        within["late"] = {"state": e.late_settle, "reason": e.late_reason,
                          "history": [{"kind": h.kind, "step": h.step, "visit": h.visit, "data": h.data}
                                      for h in e.late_history]}
    doc.body["step_deadline"] = within


def _open_task(e: OpenTask, doc: _Doc) -> None:
    doc.extend("tasks", {"op": "open", "task": e.task})


def _change_task(e: ChangeTask, doc: _Doc) -> None:
    doc.extend("tasks", {"op": e.op, "task_id": e.task_id, "data": e.data})


def _subscribe(e: Subscribe, doc: _Doc) -> None:
    doc.extend("subscriptions", {"names": list(e.names), "key": e.key, "visit": e.visit})


def _settle_queued(e: SettleQueued, doc: _Doc) -> None:
    doc.body.setdefault("queued", []).extend(e.command_ids)


WRITERS: dict[type[Effect], Callable[[Any, _Doc], None]] = {
    MovePosition: _move,
    SetState: _state,
    RecordHistory: _history,
    Enqueue: _enqueue,
    CloseTimers: _close_timers,
    RequeueSignals: _requeue,
    OpenBranches: _open,
    CloseBranches: _close,
    EndInstance: _end,
    EmitEvent: _event,
    StartChild: _child,
    NotifyParent: _notify,
    IfStopped: _if_stopped,
    OpenExternalTask: _external_task,
    RecordCompensable: _compensable,
    AdvanceSaga: _saga,
    ScheduleStepDeadline: _step_deadline,
    InterruptStep: _interrupt,
    WithinStepDeadline: _within_deadline,
    OpenTask: _open_task,
    ChangeTask: _change_task,
    Subscribe: _subscribe,
    RedactClaimedPayload: _redact_payload,
    SettleQueued: _settle_queued,
}
"""Effect type -> the writer of its section of the commit document."""

SECTION_SQL: dict[type[Effect], str] = {
    MovePosition: "UPDATE {{schema}}.positions p SET",
    SetState: "WHEN v_has_state THEN d->'state'",
    RecordHistory: "INSERT INTO {{schema}}.history",
    Enqueue: "INSERT INTO {{schema}}.commands AS c",
    CloseTimers: "last_error = 'WAIT_LEFT'",
    RequeueSignals: "d->'requeue'",
    OpenBranches: "{{schema}}.open_branches(",
    CloseBranches: "{{schema}}.close_branches(",
    EndInstance: "last_error = 'INSTANCE_ENDED'",
    EmitEvent: "INSERT INTO {{schema}}.outbox",
    StartChild: "{{schema}}.start_children(",
    NotifyParent: "'CHILD_COMPLETION'",
    IfStopped: "d->'if_stopped'",
    OpenExternalTask: feature_section("external_tasks"),
    RecordCompensable: feature_section("compensable"),
    AdvanceSaga: feature_section("saga"),
    ScheduleStepDeadline: feature_section("step_deadlines"),
    InterruptStep: feature_section("interrupts"),
    WithinStepDeadline: "d ? 'step_deadline'",
    OpenTask: feature_section("tasks"),
    ChangeTask: feature_section("tasks"),
    Subscribe: feature_section("subscriptions"),
    RedactClaimedPayload: feature_section("redacted_payloads"),
    SettleQueued: "d->'queued'",
}
"""Effect type -> the SQL in `commit_decision` that carries out its section (checked by a test)."""


def commit_document(
    decision: Decision,
    *,
    instance_id: str,
    position: str,
    command_id: int,
    token: Any,
    visit: int,
    state_version: int,
    version: int,
    lease_seconds: float,
    worker: str,
    actor: str | None = None,
) -> dict[str, Any]:
    """The JSON one `commit_decision` call reads: the claim, the settlement, and every effect."""
    doc = _Doc(instance_id, position, visit)
    for effect in decision.effects:
        WRITERS[type(effect)](effect, doc)
    settle = decision.settle
    return {
        "instance": instance_id,
        "position": position,
        "command": command_id,
        "token": str(token),
        "state_version": state_version,
        "version": version,  # the pinned version the segment ran: a migration since fences the commit
        "settle": {"state": settle.state, "reason": settle.reason, "retry_delay": settle.retry_delay},
        "continuation": decision.continuation is not None,
        "lease_seconds": lease_seconds,
        "worker": worker,
        "actor": actor,
        **doc.body,
    }
