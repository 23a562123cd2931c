"""Entering a human task step: the task's row and the position's wait and timers.

The reminder, due date and expiry are TIMER commands of the position (`remind`, `due`, `expire`),
handled by `core.task_transitions` when they fire.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from stepstone.core.effects import Effect, Enqueue, MovePosition, OpenTask
from stepstone.core.effects import RecordHistory as History
from stepstone.core.limits import MAX_INDEXED_NAME, label_problem
from stepstone.core.model import JSON, WAITING, InstanceView
from stepstone.core.plan import Step
from stepstone.core.task_spec import (
    fill,
    lookup,
    name_of,
    priority_of,
    resolve,
    resolve_instant,
    resolve_names,
    task_id,
)


def names_problem(step: Step, people: dict[str, Any]) -> str | None:
    """Why the task cannot open with the names the state gives its people (`task_people`), if it cannot:
    a name no user or group can have would leave the task to admins alone (every task operation refuses
    such an actor: `Limits.check_label`), and one longer than an index entry holds fails its commit."""
    for what, named in people.items():
        listed = what in ("candidate_users", "candidate_groups")  # the assignee and the owner are one name each
        for name in named if listed else [named]:
            if name is None and not listed:
                continue  # no assignee or owner: the task names nobody there
            where = f"task step {step.name!r}: a name of its {what} from the state"
            if not isinstance(name, str):
                shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."
                return f"{where}, {shown}, is not a text or a number"
            if len(name) > MAX_INDEXED_NAME:
                return f"{where} has {len(name):,} characters; at most {MAX_INDEXED_NAME} are indexed"
            if (problem := label_problem(name)) is not None:
                return f"{where} {problem}"
    return None


def dates_problem(step: Step, state: JSON, now: datetime) -> str | None:
    """Why the task cannot open with the due date or follow-up date the state gives it, if it cannot: a
    value that is there but no instant (a naive timestamp, a word) would silently be no date at all."""
    spec = step.task
    assert spec is not None
    for what, value in (("due", spec.due), ("follow_up", spec.follow_up)):
        got = resolve(value, state)
        if got is not None and resolve_instant(value, state, now) is None:
            shown = repr(got) if len(repr(got)) <= 80 else repr(got)[:77] + "..."
            return (f"task step {step.name!r}: its {what} from the state, {shown}, is not an ISO 8601 instant with "
                    "a zone (years 1 to 9999 in UTC) nor a number of seconds (at most a thousand years)")
    return None


def task_people(instance: InstanceView, step: Step, state: JSON) -> dict[str, Any]:
    """Who the task is for, as the state names them when it opens (read once: checked, then opened)."""
    spec = step.task
    assert spec is not None
    item = instance.branch.item if instance.branch is not None else None
    return {"assignee": _name(resolve(spec.assignee, state, item)), "owner": _name(resolve(spec.owner, state, item)),
            "candidate_users": resolve_names(spec.candidate_users, state, item),
            "candidate_groups": resolve_names(spec.candidate_groups, state, item)}


def enter_task(
    instance: InstanceView, step: Step, visit: int, state: JSON, now: datetime, people: dict[str, Any],
) -> list[Effect]:
    """Open the task of a task step, for `people` (`task_people`), and wait for it."""
    spec = step.task
    assert spec is not None
    tid = task_id(instance.id, instance.position, step.name, visit)
    item = instance.branch.item if instance.branch is not None else None
    priority = resolve(spec.priority, state, item)
    task: dict[str, Any] = {
        "id": tid, "step": step.name, "visit": visit,
        "title": fill(spec.title, state), "description": fill(spec.description, state),
        **people,
        "priority": priority_of(priority),
        "decisions": sorted(step.decisions), "form": form_schema(step),
        "data": {f: lookup(state, f) for f in spec.show},
        "due_at": resolve_instant(spec.due, state, now),
        "follow_up_at": resolve_instant(spec.follow_up, state, now),
        "require_version_stability": spec.require_version_stability,
    }
    wait = {"kind": "task", "task_id": tid, "decisions": dict(step.decisions)}
    opened = {k: task[k] for k in ("id", "title", "assignee", "candidate_users", "candidate_groups", "due_at")}
    timers: list[Effect] = []
    if spec.reminder_seconds is not None:
        timers.append(Enqueue("TIMER", step.name, visit, name="remind", delay=spec.reminder_seconds))
    if task["due_at"] is not None:
        timers.append(Enqueue("TIMER", step.name, visit, name="due", at=max(task["due_at"], now.isoformat())))
    if spec.expire_seconds is not None:
        timers.append(Enqueue("TIMER", step.name, visit, name="expire", delay=spec.expire_seconds))
    return [MovePosition(WAITING, step.name, visit, wait=wait), History("TASK_OPENED", step.name, visit, opened),
            OpenTask(task), *timers]


def form_schema(step: Step) -> dict[str, Any]:
    """The JSON Schema of a completion of this step: one alternative per decision (for UIs)."""
    spec = step.task
    forms = spec.forms if spec is not None else {}
    return {
        "type": "object",
        "oneOf": [
            {"properties": {"decision": {"const": name}, "payload": forms.get(name) or {"type": "null"}},
             "required": ["decision"]}
            for name in sorted(step.decisions)
        ],
    }


def _name(value: JSON) -> JSON:
    return None if value is None or value == "" else name_of(value)
