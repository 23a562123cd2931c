"""Saved inbox filters of `Client`: a user names an inbox (its mode and its `TaskFilter`) once, then lists,
uses (`client.tasks(user=..., saved_filter=NAME)`) and deletes it. A filter belongs to one user in one
scope (the tenant key): the same name of another user or scope is another filter, and using a filter
shows only its scope's tasks. Saving a name again replaces it. Filters are rows (migration 0014): they
outlive the process that saved them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime
from typing import Any

from stepstone.core.limits import Limits, PayloadRejected
from stepstone.core.pin import DEFAULT_SCOPE
from stepstone.errors import InvalidInput, TaskFilterNotFound
from stepstone.store.port import ClientStore
from stepstone.store.task_port import TaskFilter

__all__ = ["INBOX_MODES", "SavedTaskFilter", "TaskFilter", "TaskFilterOperations"]

INBOX_MODES = ("inbox", "assigned", "candidate", "all")
_INSTANTS = ("due_before", "follow_up_before")


@dataclass(frozen=True)
class SavedTaskFilter:
    """A named inbox of one user in one scope: `client.tasks(mode=..., where=...)` with these."""

    name: str
    user: str
    scope: str
    mode: str
    where: TaskFilter
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> SavedTaskFilter:
        stored = dict(row["filter"])
        for k in _INSTANTS:
            if stored.get(k) is not None:
                stored[k] = datetime.fromisoformat(stored[k])
        known = {f.name for f in fields(TaskFilter)}
        where = TaskFilter(**{k: v for k, v in stored.items() if k in known})
        return cls(name=str(row["name"]), user=str(row["owner"]), scope=str(row["scope"]), mode=str(row["mode"]),
                   where=where, created_at=row["created_at"], updated_at=row["updated_at"])


def _document(where: TaskFilter) -> dict[str, Any]:
    doc = asdict(where)
    for k in _INSTANTS:
        if doc[k] is not None:
            doc[k] = doc[k].isoformat()
    return doc


class TaskFilterOperations:
    """The saved-filter half of the task operations (a base of `TaskOperations`)."""

    store: ClientStore
    limits: Limits

    async def save_task_filter(
        self, name: str, *, user: str, mode: str = "inbox", where: TaskFilter | None = None,
        scope: str = DEFAULT_SCOPE,
    ) -> SavedTaskFilter:
        """Save (or replace) the user's inbox filter `name` in `scope`. `where.scope`, when given, must be
        `scope`: a filter only ever shows its own scope's tasks."""
        key = self._filter_key(name, user, scope)
        if mode not in INBOX_MODES:
            raise InvalidInput(f"mode must be one of {', '.join(INBOX_MODES)}, got {mode!r}", what="mode")
        where = where or TaskFilter()
        if where.scope is not None and where.scope != scope:
            raise InvalidInput(f"a filter saved in scope {scope!r} cannot show scope {where.scope!r}", what="scope")
        for k in _INSTANTS:
            value = getattr(where, k)
            if value is not None and value.tzinfo is None:
                raise InvalidInput(f"{k} needs a time zone (an ISO 8601 instant with an offset)", what=k)
        row = await self.store.save_task_filter(*key, mode, _document(replace(where, scope=scope)))
        return SavedTaskFilter.from_row(row)

    async def task_filters(self, *, user: str, scope: str = DEFAULT_SCOPE) -> tuple[SavedTaskFilter, ...]:
        """The user's saved filters in `scope`, by name."""
        scope, user = self._filter_key("-", user, scope)[:2]
        return tuple(SavedTaskFilter.from_row(r) for r in await self.store.task_filters(scope, user))

    async def task_filter(self, name: str, *, user: str, scope: str = DEFAULT_SCOPE) -> SavedTaskFilter:
        """One saved filter; `TaskFilterNotFound` when the user has none of that name in `scope`."""
        key = self._filter_key(name, user, scope)
        row = await self.store.task_filter(*key)
        if row is None:
            raise TaskFilterNotFound(name, user=key[1], scope=key[0])
        return SavedTaskFilter.from_row(row)

    async def delete_task_filter(self, name: str, *, user: str, scope: str = DEFAULT_SCOPE) -> bool:
        """Delete a saved filter; False when there was none of that name."""
        return await self.store.delete_task_filter(*self._filter_key(name, user, scope))

    def _filter_key(self, name: str, user: str, scope: str) -> tuple[str, str, str]:
        try:
            return (self.limits.check_text("scope", scope), self.limits.check_text("user", user),
                    self.limits.check_text("filter name", name))
        except PayloadRejected as exc:
            raise InvalidInput(str(exc), what=exc.what) from None
