"""What a task step declares: who works on it, what they see, what they may decide, and its dates.

Every value that may come from the instance's state is either a literal, `{"state": "a.b"}` (a
dotted path into the state) or, in a map branch, `{"item": "a.b"}` (into the branch's item),
resolved when the step is entered (`resolve`). The spec is JSON all
the way down, so it enters the plan hash and the stored plan document as it is.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from stepstone.core.bounds import is_whole
from stepstone.core.limits import MAX_INT4, label_problem
from stepstone.core.timestamps import storable, within_max

JSON = Any

_TASKS = uuid.UUID("7d3f9a10-2c4b-4e8d-b6a1-93c0e5f47b21")


def task_id(instance_id: str, position: str, step: str, visit: int) -> str:
    """The task one visit of one task step opens: the same id on every attempt of that commit."""
    return str(uuid.uuid5(_TASKS, f"{instance_id}/{position}/{step}/{visit}"))


@dataclass(frozen=True)
class TaskSpec:
    """A task step's declaration. Values marked *state* may be `{"state": "path"}`.

    title, description: what the task is (text; `{field}` placeholders are filled from the state).
    assignee, owner (*state*): a user name. candidate_users, candidate_groups (*state*): names.
    priority (*state*): an integer, higher first. show: the state fields the assignee sees.
    forms: decision -> JSON Schema of its payload (None: no payload).
    due, follow_up (*state*): seconds from entering, or an ISO 8601 instant with a zone.
    reminder_seconds: a reminder this long after entering. escalate_user / escalate_group: who the task
    goes to when it is due. expire_seconds + on_expire: the task expires and the position goes on there.
    require_version_stability: a completion must name the state version it reviewed.
    """

    title: str
    description: str = ""
    assignee: JSON = None
    owner: JSON = None
    candidate_users: JSON = ()
    candidate_groups: JSON = ()
    priority: JSON = 50
    show: tuple[str, ...] = ()
    forms: Mapping[str, JSON] = field(default_factory=dict)
    due: JSON = None
    follow_up: JSON = None
    reminder_seconds: float | None = None
    escalate_user: str | None = None
    escalate_group: str | None = None
    expire_seconds: float | None = None
    on_expire: str | None = None
    require_version_stability: bool = False

    def describe(self) -> dict[str, Any]:
        return {
            "title": self.title, "description": self.description, "assignee": self.assignee,
            "owner": self.owner, "candidate_users": _listed(self.candidate_users),
            "candidate_groups": _listed(self.candidate_groups), "priority": self.priority,
            "show": list(self.show), "forms": dict(sorted(self.forms.items())), "due": self.due,
            "follow_up": self.follow_up, "reminder_seconds": self.reminder_seconds,
            "escalate_user": self.escalate_user, "escalate_group": self.escalate_group,
            "expire_seconds": self.expire_seconds, "on_expire": self.on_expire,
            "require_version_stability": self.require_version_stability,
        }

    def problems(self, where: str, decisions: Mapping[str, str]) -> list[str]:
        found = []
        if not self.title:
            found.append(f"{where}: a task needs a title")
        if not decisions:
            found.append(f"{where}: a task needs at least one decision")
        found.extend(f"{where}: form for unknown decision {d!r}" for d in self.forms if d not in decisions)
        if (self.expire_seconds is None) != (self.on_expire is None):
            found.append(f"{where}: expire and on_expire go together")
        for attr, name in (("reminder_seconds", "reminder"), ("expire_seconds", "expire")):  # as authors write it
            value = getattr(self, attr)
            if value is not None and value < 0:
                found.append(f"{where}: {name} must not be negative")
            elif value is not None and not within_max(value):
                found.append(f"{where}: {name} must be at most a thousand years, got {value} s")
        for name in ("due", "follow_up"):  # seconds from entering; {"state": ...} is read when the task opens
            value = getattr(self, name)
            if isinstance(value, int | float) and not isinstance(value, bool) and not within_max(abs(value)):
                found.append(f"{where}: {name} must be at most a thousand years, got {value} s")
        if not isinstance(self.priority, dict) and not is_priority(self.priority):
            found.append(f"{where}: priority must be a whole number from {-MAX_INT4 - 1:,} to {MAX_INT4:,} "
                         f"(or read from the state), got {self.priority!r}")
        if self.escalate_user and self.escalate_group:
            found.append(f"{where}: escalate to a user or to a group, not both")
        found.extend(f"{where}: {what} {problem}" for what, name in self._literal_names()
                     if (problem := label_problem(name)) is not None)
        return found

    def _literal_names(self) -> list[tuple[str, str]]:
        """The user and group names the declaration gives as text (not `from_state`): a name no user or group
        can have (`label_problem`) would give the task, or its escalation, to nobody."""
        named = [(what, getattr(self, what)) for what in ("assignee", "owner", "escalate_user", "escalate_group")]
        for what in ("candidate_users", "candidate_groups"):
            value = getattr(self, what)
            named.extend((what, v) for v in (value if isinstance(value, list | tuple) else [value]))
        return [(what, value) for what, value in named if isinstance(value, str)]


def is_priority(value: JSON) -> bool:
    """A whole number the tasks' priority column (int4) holds."""
    return is_whole(value, -MAX_INT4 - 1, MAX_INT4)


def priority_of(value: JSON) -> int:
    """A task's priority read from the state: a whole number, held to the column's range (a larger one
    failed the commit that opens the task, on every claim, until the instance was dead-lettered); 50,
    the default, for anything else."""
    if not isinstance(value, int) or isinstance(value, bool):
        return 50
    return min(max(value, -MAX_INT4 - 1), MAX_INT4)


def _listed(value: JSON) -> JSON:
    return list(value) if isinstance(value, tuple | list) else value


def lookup(state: JSON, path: str) -> JSON:
    """The value at a dotted path of the state; None when any part is missing."""
    value = state
    for part in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def resolve(value: JSON, state: JSON, item: JSON = None) -> JSON:
    """A literal as it is, `{"state": path}` from the state, `{"item": path}` from a map branch's item
    (the whole item when the path is empty)."""
    if isinstance(value, dict) and set(value) == {"state"} and isinstance(value["state"], str):
        return lookup(state, value["state"])
    if isinstance(value, dict) and set(value) == {"item"} and isinstance(value["item"], str):
        return lookup(item, value["item"]) if value["item"] else item
    return value


def name_of(value: JSON) -> JSON:
    """A user's or a group's name as the state gives it: a text as it is, a number as its text; anything
    else (a boolean, a list, a map, null) as it is, which the task refuses before it opens
    (`core.task_entering.names_problem`) rather than take Python's text of it ("['ann']", "True")."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def resolve_names(value: JSON, state: JSON, item: JSON = None) -> list[JSON]:
    """The names a list of people reads (one name or a list of them), sorted and without repeats; as
    given when one is not a name, for `names_problem` to refuse."""
    got = resolve(value, state, item)
    if got is None:
        return []
    names = [name_of(v) for v in (got if isinstance(got, list | tuple) else [got])]
    return sorted(set(names)) if all(isinstance(n, str) for n in names) else names


def resolve_instant(value: JSON, state: JSON, now: datetime) -> str | None:
    """Seconds from now, or an ISO instant with a zone (from the state or literal); None otherwise."""
    got = resolve(value, state)
    if isinstance(got, bool) or got is None:
        return None
    if isinstance(got, int | float):  # from the state: seconds past a thousand years are none
        return (now + timedelta(seconds=float(got))).isoformat() if within_max(abs(got)) else None
    if isinstance(got, str):
        try:
            parsed = datetime.fromisoformat(got)
        except ValueError:
            return None
        return parsed.isoformat() if parsed.tzinfo is not None and storable(parsed) else None
    return None


def fill(text: str, state: JSON) -> str:
    """`{field}` placeholders of a title filled from the state's top-level fields; others left as they are."""
    if "{" not in text or not isinstance(state, dict):
        return text
    out = text
    for key, val in state.items():
        if isinstance(val, str | int | float) and not isinstance(val, bool):
            out = out.replace("{" + key + "}", str(val))
    return out
