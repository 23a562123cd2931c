"""Human task operations of `Client`: the inbox, claim, unclaim, reassign, delegate, resolve, complete.

`TaskOperations` is a base of `Client` (so `SyncClient` has the same methods). Every operation names
its actor (the client's `actor` unless given) and the actor's groups; `admin=True` overrides the
assignee and candidate checks, and is recorded in the task's history. A completion reserves the task
(OPEN -> COMPLETING) and records its command in one transaction; a worker's segment then completes it
and moves the instance (or refuses it and reopens the task): `TaskCompletion.command_id` is that command.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ValidationError

from stepstone import cursors
from stepstone.authoring.workflow import Registry
from stepstone.client_task_filters import SavedTaskFilter, TaskFilter, TaskFilterOperations
from stepstone.core.bounds import is_whole
from stepstone.core.limits import MAX_INT8, Limits, PayloadRejected
from stepstone.errors import (
    IdempotencyConflict,
    InvalidInput,
    StateChangedSinceReview,
    TaskHeld,
    TaskNotFound,
    TaskNotOpen,
    TaskNotPermitted,
    TaskRefused,
    UnknownDecision,
    refused,
)
from stepstone.json_schemas import schema_refusal
from stepstone.store.port import ClientStore
from stepstone.store.task_port import InboxMode, TaskQuery

__all__ = ["BulkReassignment", "SavedTaskFilter", "TaskCompletion", "TaskFilter", "TaskInfo", "TaskOperations",
           "TaskPage"]

OPEN_STATUSES = ("OPEN", "COMPLETING")


@dataclass(frozen=True)
class TaskInfo:
    """A human task as stored: who holds it, who may take it, what it shows and what it takes."""

    id: str
    instance_id: str
    position: str
    step: str
    visit: int
    definition_id: str
    status: str
    title: str
    description: str
    assignee: str | None
    owner: str | None
    delegation: str | None
    candidate_users: list[str]
    candidate_groups: list[str]
    priority: int
    decisions: list[str]
    form: Any
    """JSON Schema of a completion: one alternative per decision, with its payload's schema."""
    data: Any
    """The state fields the task shows (a projection of the state when it opened)."""
    state_version: int
    """The version of the shown data; a completion that requires version stability names it."""
    require_version_stability: bool
    due_at: datetime | None
    follow_up_at: datetime | None
    reminded_at: datetime | None
    escalated_at: datetime | None
    completion: Any
    """The recorded completion (decision, payload, actor, command), once one was reserved."""
    created_at: datetime
    updated_at: datetime
    ended_at: datetime | None
    version: int | None = None
    """The workflow version the task's instance is pinned to (set by `task`)."""
    scope: str | None = None
    """The scope (tenant key) of the task's instance."""

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> TaskInfo:
        names = set(cls.__dataclass_fields__)
        values: dict[str, Any] = {k: (str(v) if k in ("id", "instance_id") else v)
                                  for k, v in row.items() if k in names}
        for k in ("due_at", "follow_up_at", "reminded_at", "escalated_at", "created_at", "updated_at", "ended_at"):
            if isinstance(values.get(k), str):
                values[k] = datetime.fromisoformat(values[k])
        return cls(**values)


@dataclass(frozen=True)
class TaskPage:
    """One page of an inbox, in inbox order; pass `next_cursor` as `after` for the next page."""

    tasks: list[TaskInfo] = field(default_factory=list)
    next_cursor: str | None = None


@dataclass(frozen=True)
class TaskCompletion:
    """A reserved completion: the task (COMPLETING), the command a worker applies, and whether this
    call repeated an earlier one with the same idempotency key (then nothing new was recorded)."""

    task: TaskInfo
    command_id: int | None
    duplicate: bool = False


@dataclass(frozen=True)
class BulkReassignment:
    """What a bulk reassign did (or, on a dry run, would do): tasks moved, tasks skipped (COMPLETING)."""

    reassigned: int
    skipped: int
    dry_run: bool


class TaskOperations(TaskFilterOperations):
    """The task half of `Client` (its attributes are set by `Client.__init__`)."""

    store: ClientStore
    registry: Registry
    limits: Limits
    actor: str | None

    async def task(self, task_id: str) -> TaskInfo:
        """One task, any status."""
        return TaskInfo.from_row(await self.store.get_task(self._task_text("task id", task_id)))

    async def tasks(
        self,
        *,
        user: str | None = None,
        groups: Sequence[str] = (),
        mode: str | None = None,
        where: TaskFilter | None = None,
        after: str | None = None,
        limit: int = 50,
        saved_filter: str | None = None,
        scope: str | None = None,
    ) -> TaskPage:
        """Open tasks (OPEN or COMPLETING) in inbox order: priority first, then oldest. `mode` (default
        inbox): inbox (the user's tasks, and unassigned ones offered to the user or their groups),
        assigned, candidate, or all (every open task; `user` and `groups` then filter by assignee and
        candidate group). `where` narrows it further. `saved_filter` names a filter `user` saved in
        `scope` (default scope unless given): its mode and its `where` (then neither may be passed)."""
        user, mode, where = await self._inbox_of(user, mode, where, saved_filter, scope)
        query = self._task_query(user, groups, mode, where, after, limit)
        rows = await self.store.list_tasks(query)
        tasks = [TaskInfo.from_row(r) for r in rows]
        cursor = _cursor(tasks[-1]) if len(tasks) == query.limit else None
        return TaskPage(tasks, cursor)

    async def count_tasks(
        self, *, user: str | None = None, groups: Sequence[str] = (), mode: str | None = None,
        where: TaskFilter | None = None, saved_filter: str | None = None, scope: str | None = None,
    ) -> int:
        """How many open tasks `tasks` would list with the same arguments, without fetching them."""
        user, mode, where = await self._inbox_of(user, mode, where, saved_filter, scope)
        return await self.store.count_tasks(self._task_query(user, groups, mode, where, None, 1))

    async def _inbox_of(
        self, user: str | None, mode: str | None, where: TaskFilter | None, saved_filter: str | None,
        scope: str | None,
    ) -> tuple[str | None, str, TaskFilter]:
        """The user, mode and filter of an inbox call: as passed, or those of the user's saved filter. A
        saved filter of mode `all` is every open task its `where` keeps: its owner does not narrow it to
        the owner's own tasks (as `user` does in mode all)."""
        if saved_filter is None:
            if scope is not None:
                raise InvalidInput("scope names where a saved filter lives; pass it with saved_filter "
                                   "(or filter by TaskFilter(scope=...))", what="scope")
            return user, mode or "inbox", where or TaskFilter()
        if where is not None or mode is not None:
            raise InvalidInput("a saved filter brings its own mode and filter: pass saved_filter alone",
                               what="saved_filter")
        if user is None:
            raise InvalidInput("a saved filter is a user's: pass user", what="user")
        saved = await self.task_filter(saved_filter, user=user, **({} if scope is None else {"scope": scope}))
        return (None if saved.mode == "all" else user), saved.mode, saved.where

    async def instance_tasks(self, instance_id: str) -> tuple[dict[str, Any], ...]:
        """Every task an instance opened, oldest first (id, position, step, visit, status, title, assignee)."""
        return tuple(await self.store.instance_tasks(self._task_text("instance id", instance_id)))

    async def claim_task(
        self, task_id: str, *, actor: str | None = None, groups: Sequence[str] = (), admin: bool = False,
    ) -> TaskInfo:
        """Take an unassigned task as its assignee. A task someone else holds is refused (`TaskHeld`)
        unless `admin` (recorded); claiming one's own task again changes nothing."""
        return await self._assign(task_id, "claim", None, actor, groups, admin, "", None)

    async def unclaim_task(self, task_id: str, *, actor: str | None = None, groups: Sequence[str] = (),
                           admin: bool = False) -> TaskInfo:
        """Give a task back to its candidates (only its assignee, or an admin). Unclaiming a task nobody
        holds changes nothing, and is refused (TaskNotPermitted) to anyone who may not work on it."""
        return await self._assign(task_id, "unclaim", None, actor, groups, admin, "", None)

    async def reassign_task(
        self, task_id: str, to: str, *, actor: str | None = None, reason: str = "",
        idempotency_key: str | None = None, admin: bool = False,
    ) -> TaskInfo:
        """Give a task to another user (its assignee, its owner or an admin may)."""
        return await self._assign(task_id, "reassign", to, actor, (), admin, reason, idempotency_key)

    async def delegate_task(
        self, task_id: str, to: str, *, actor: str | None = None, reason: str = "",
        idempotency_key: str | None = None, admin: bool = False,
    ) -> TaskInfo:
        """Delegate a task: `to` works on it and `resolve_task` gives it back to its owner (the assignee
        who delegated it, unless the task had an owner already)."""
        return await self._assign(task_id, "delegate", to, actor, (), admin, reason, idempotency_key)

    async def resolve_task(self, task_id: str, *, actor: str | None = None, admin: bool = False) -> TaskInfo:
        """The delegate hands a delegated task back to its owner."""
        return await self._assign(task_id, "resolve", None, actor, (), admin, "", None)

    async def complete_task(
        self,
        task_id: str,
        decision: str,
        payload: Any = None,
        *,
        actor: str | None = None,
        groups: Sequence[str] = (),
        idempotency_key: str | None = None,
        reviewed_version: int | None = None,
        admin: bool = False,
    ) -> TaskCompletion:
        """Complete a task with one of its decisions and that decision's payload (validated by its model).

        Refused with a typed error, nothing changed: an unknown decision (`UnknownDecision`), a payload
        failing its model (`InvalidInput`), an actor who is neither assignee, owner nor candidate
        (`TaskNotPermitted`, unless `admin`), a task not OPEN (`TaskNotOpen`, carrying the completion
        that won), a changed state where the task requires version stability (`StateChangedSinceReview`).
        The same `idempotency_key` with the same decision and payload by the same actor returns the earlier
        completion, before any check of the payload, while that completion holds the task; once it was handed
        back (refused, or dead-lettered and the task given back by a retry) the request is taken anew. With
        another request, or by another actor, `IdempotencyConflict`."""
        tid = self._task_text("task id", task_id)
        who = self._who(actor)
        self._task_text("decision", decision)
        if reviewed_version is not None and not is_whole(reviewed_version, 0, MAX_INT8):
            # A version the task's bigint column cannot hold reached the driver (its DataError).
            raise InvalidInput(f"reviewed_version must be a whole number from 0 to {MAX_INT8:,}, got "
                               f"{reviewed_version!r}", what="reviewed_version")
        key = None if idempotency_key is None else self._task_text("idempotency key", idempotency_key)
        row = await self.store.get_task(tid)
        if isinstance(payload, BaseModel):
            payload = payload.model_dump(mode="json")
        # The request as given (the same whether or not this client has the decision's model to fill defaults),
        # and who makes it: another actor's repeat of a key is another command (_request_fingerprint).
        fingerprint = _request_fingerprint(who, "complete", decision, payload)
        legacy = _fingerprint("complete", decision, payload)
        try:
            if decision not in row["decisions"]:
                raise UnknownDecision(decision, tid, tuple(row["decisions"]))
            payload = self._checked_payload(row, decision, payload)
        except InvalidInput:
            # A completion recorded under this key with this request answers as recorded, before any payload
            # check: this caller may check otherwise (another model, or the form) than the one that recorded it.
            seen = None if key is None else await self.store.task_key_seen("TASK_COMPLETE", tid, key, fingerprint)
            if key is not None and seen == "duplicate":
                return _completion(TaskInfo.from_row(await self.store.get_task(tid)), duplicate=True)
            if key is not None and seen == "conflict" and (
                    recorded := await self._earlier_release_recorded("TASK_COMPLETE", tid, key, legacy, who)):
                return _completion(TaskInfo.from_row(recorded), duplicate=True)
            raise
        outcome, task, changed = await self.store.task_complete(
            tid, decision, payload, actor=who, groups=self._groups(groups), force=admin, key=key,
            fingerprint=fingerprint, reviewed_version=reviewed_version,
        )
        if outcome in ("reserved", "duplicate"):
            return _completion(TaskInfo.from_row(task or {}), duplicate=outcome == "duplicate")
        if outcome == "stale":
            info = TaskInfo.from_row(task or {})
            raise StateChangedSinceReview(
                f"task {tid} shows data of version {info.state_version}"
                + (f"; changed since: {', '.join(changed)}" if changed else f", not {reviewed_version}")
                + "; nothing was completed",
                task_id=tid, status=info.status, reviewed_version=reviewed_version,
                shown_version=info.state_version, changed=tuple(changed),
            )
        if outcome == "conflict" and key is not None and (
                recorded := await self._earlier_release_recorded("TASK_COMPLETE", tid, key, legacy, who)):
            return _completion(TaskInfo.from_row(recorded), duplicate=True)
        raise self._refusal(outcome, tid, who, task, idempotency_key)

    async def reassign_all_tasks(
        self, from_user: str, to_user: str, *, actor: str | None = None, reason: str = "", dry_run: bool = False,
    ) -> BulkReassignment:
        """Move every open task of `from_user` to `to_user` (an absent colleague's), each with a history
        entry; tasks being completed are skipped and counted. `dry_run` counts and changes nothing. Moving
        them to `from_user` itself is refused (`InvalidInput`): it would record a move that changed nothing."""
        who = self._who(actor)
        source, target = self._user("from user", from_user), self._user("to user", to_user)
        if source == target:
            raise InvalidInput(f"from and to are both {source!r}: their tasks are theirs already, nothing was "
                               "reassigned", what="to user")
        done, skipped = await self.store.task_reassign_all(
            source, target, actor=who,
            reason=self._task_text("reason", reason, free=True), dry_run=dry_run,
        )
        return BulkReassignment(done, skipped, dry_run)

    # -- helpers --------------------------------------------------------------------------------

    async def _assign(
        self, task_id: str, op: str, to: str | None, actor: str | None, groups: Sequence[str], admin: bool,
        reason: str, key: str | None,
    ) -> TaskInfo:
        tid = self._task_text("task id", task_id)
        who = self._who(actor)
        if to is not None:
            self._user("to", to)
        reason = self._task_text("reason", reason, free=True)
        outcome, task = await self.store.task_assign(
            tid, op, to=to, actor=who, groups=self._groups(groups), force=admin, reason=reason,
            key=None if key is None else self._task_text("idempotency key", key),
            fingerprint=_request_fingerprint(who, op, to, reason),
        )
        if outcome == "unchanged" and op == "unclaim" and not admin and not _may_work(task or {}, who, groups):
            outcome = "not_permitted"  # an unassigned task: nothing to give back, but not theirs to touch either
        if outcome in ("ok", "unchanged", "duplicate"):
            return TaskInfo.from_row(task or {})
        if outcome == "conflict" and key is not None and (recorded := await self._earlier_release_recorded(
                "TASK_OP", tid, key, _fingerprint(op, to, reason), None)):
            return TaskInfo.from_row(recorded)
        raise self._refusal(outcome, tid, who, task, key)

    async def _earlier_release_recorded(self, kind: str, tid: str, key: str, legacy: str,
                                        who: str | None) -> dict[str, Any] | None:
        """The task, when a release before the actor joined the fingerprint recorded this key with this request:
        its repeat stays a duplicate across the upgrade, as it was then. A completion names its actor, so only
        that actor's repeat counts (`who`); a reassignment's key names none (None: any actor's, as then)."""
        if await self.store.task_key_seen(kind, tid, key, legacy) != "duplicate":
            return None
        task = await self.store.get_task(tid)
        completion = task.get("completion") or {}
        return task if who is None or (completion.get("key") == key and completion.get("actor") == who) else None

    def _refusal(  # noqa: PLR0911 - one answer per refusal
        self, outcome: str, tid: str, who: str, task: dict[str, Any] | None, key: str | None,
    ) -> Exception:
        if outcome == "not_found" or task is None:
            return TaskNotFound(tid)
        status, assignee = str(task["status"]), task.get("assignee")
        completion = task.get("completion") if isinstance(task.get("completion"), dict) else None
        if outcome == "not_open":
            won = f" (by {completion.get('actor')}: {completion.get('decision')})" if completion else ""
            return TaskNotOpen(f"task {tid} is {status}{won}; nothing was changed", task_id=tid, status=status,
                               assignee=assignee, completion=completion)
        if outcome == "held":
            return TaskHeld(f"task {tid} is held by {assignee}; claim it with admin override to take it over",
                            task_id=tid, status=status, assignee=assignee)
        if outcome == "not_permitted":
            return TaskNotPermitted(f"{who} may not do that with task {tid} (assignee {assignee or 'none'})",
                                    task_id=tid, status=status, actor=who, assignee=assignee)
        if outcome == "not_delegated":
            return TaskRefused(f"task {tid} is not delegated; there is nothing to resolve", task_id=tid,
                               status=status, assignee=assignee)
        if outcome == "conflict":
            # A recorded completion names its key and actor; a reassignment's key is known only by its fingerprint.
            by = "by another actor or with another request"
            if completion and completion.get("key") == key:
                by = "by another actor" if completion.get("actor") != who else "with another request"
            return IdempotencyConflict(f"idempotency key {key!r} was already used on task {tid} {by}; nothing was "
                                       "changed", instance_id=str(task["instance_id"]))
        return TaskRefused(f"task {tid}: {outcome}", task_id=tid, status=status, assignee=assignee)

    def _checked_payload(self, row: dict[str, Any], decision: str, payload: Any) -> Any:
        """The payload as JSON, validated by the decision's model (or, without the workflow's code here,
        by the decision's JSON Schema in the task's form)."""
        try:
            self.limits.encode("task payload", payload)
        except PayloadRejected as exc:
            raise refused(exc) from None
        wf = self.registry.find(str(row["definition_id"]), int(row["version"]))
        model = wf.payload_model(str(row["step"]), decision) if wf is not None else None
        if model is not None:
            try:
                return model.model_validate(payload).model_dump(mode="json")
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first.get("loc", ())) or "payload"
                raise InvalidInput(f"payload of decision {decision!r} is invalid: {where}: {first.get('msg')}",
                                   what="payload") from None
        return _check_form(row.get("form"), decision, payload)

    def _task_query(
        self, user: str | None, groups: Sequence[str], mode: str, where: TaskFilter, after: str | None, limit: int,
    ) -> TaskQuery:
        modes: dict[str, InboxMode] = {"inbox": "inbox", "assigned": "assigned", "candidate": "candidate",
                                       "all": "all"}
        if mode not in modes:
            raise InvalidInput(f"mode must be one of {', '.join(modes)}, got {mode!r}", what="mode")
        if mode != "all" and user is None and not (mode == "candidate" and groups):
            raise InvalidInput(f"an inbox of mode {mode!r} needs a user", what="user")
        if not 1 <= limit <= 1000:
            raise InvalidInput(f"limit must be between 1 and 1000, got {limit}", what="limit")
        for what, value in (("user", user), ("workflow", where.workflow), ("candidate group", where.candidate_group),
                            ("scope", where.scope), *(("scope", s) for s in where.scopes or ())):
            if value is not None:
                self._task_text(what, value)
        if where.text is not None:
            self._task_text("text", where.text, free=True)
        listed = self._groups(groups)
        return TaskQuery(mode=modes[mode], user=user, groups=listed if (listed or mode != "all") else None,
                         where=replace(where, text=where.text or None, scopes=None if where.scopes is None
                                       else tuple(where.scopes)),
                         after=decode_task_cursor(after), limit=limit)

    def _who(self, actor: str | None) -> str:
        who = actor if actor is not None else self.actor
        if not who:
            raise InvalidInput("a task operation needs an actor (pass actor=, or open the client with one)",
                               what="actor")
        return self._user("actor", who)

    def _groups(self, groups: Sequence[str]) -> list[str]:
        if isinstance(groups, str):
            raise InvalidInput("groups must be a list of names, not one string", what="groups")
        return sorted({self._user("group", g) for g in groups})

    def _user(self, what: str, value: Any) -> str:
        """A user's or a group's name, as a token's name and groups are checked (`Limits.check_label`): one
        with spaces around it or a control character is no token's, so a task given to it would be in
        nobody's inbox."""
        try:
            return self.limits.check_label(what, value)
        except PayloadRejected as exc:
            raise refused(exc) from None

    def _task_text(self, what: str, value: Any, *, free: bool = False) -> str:
        try:
            return self.limits.check_text(what, value, free=free, empty=free)
        except PayloadRejected as exc:
            raise refused(exc) from None


def _check_form(form: Any, decision: str, payload: Any) -> Any:
    """The payload checked by the decision's schema in the task's form (a client without the workflow's
    code: the CLI, the API or the UI run without --app): a decision without a payload model takes none."""
    choices = form.get("oneOf", []) if isinstance(form, dict) else []
    schema = next((c["properties"]["payload"] for c in choices
                   if c.get("properties", {}).get("decision", {}).get("const") == decision), None)
    if not isinstance(schema, dict):
        return payload
    if schema.get("type") == "null":
        if payload is not None:
            raise InvalidInput(f"decision {decision!r} takes no payload", what="payload")
        return None
    # The payload's schema is validated as a document of its own: its $refs point into its own $defs.
    problem = schema_refusal(schema, payload, "payload")
    if problem is not None:
        raise InvalidInput(f"payload of decision {decision!r} is invalid: {problem}", what="payload")
    return payload


def _completion(info: TaskInfo, *, duplicate: bool) -> TaskCompletion:
    """A completion's answer: the task as it is now and the command its recorded completion names."""
    command = info.completion.get("command") if isinstance(info.completion, dict) else None
    return TaskCompletion(info, None if command is None else int(command), duplicate=duplicate)


def _may_work(task: dict[str, Any], who: str, groups: Sequence[str]) -> bool:
    """Whether `who` (in `groups`) may work on the task as the store's task_allows decides it: its assignee,
    its owner, or, while nobody holds it, a candidate (anyone, when it names no candidates)."""
    users, offered = task.get("candidate_users") or [], task.get("candidate_groups") or []
    if who in (task.get("assignee"), task.get("owner")):
        return True
    return task.get("assignee") is None and (who in users or bool(set(offered) & set(groups))
                                             or (not users and not offered))


def _fingerprint(*request: Any) -> str:
    """A request's hash: what releases before the actor joined it recorded with a key, and, with the actor
    last, what `_request_fingerprint` records now."""
    return hashlib.sha256(json.dumps(request, sort_keys=True, default=str).encode()).hexdigest()


def _request_fingerprint(actor: str, *request: Any) -> str:
    """What a task operation's idempotency key is recorded with: the request and its actor. A completion and
    a reassignment carry an actor, so the same request by another actor (one not permitted on the task, too)
    is another command: its key answers IdempotencyConflict, never the first actor's result."""
    return _fingerprint(*request, actor)


def _cursor(task: TaskInfo) -> str:
    return cursors.encode(task.priority, task.created_at.isoformat(), task.id)


TASK_CURSOR = (cursors.INT4, cursors.INSTANT, cursors.UUID)
"""A task page's key: priority (an integer column), created_at, id."""


def decode_task_cursor(cursor: str | None, what: str = "after") -> tuple[int, datetime, str] | None:
    """The key inside a task page cursor (None without one); InvalidInput naming `what` when the value is
    not a cursor `tasks` returned."""
    if cursor is None:
        return None
    priority, at, tid = cursors.decode(cursor, *TASK_CURSOR, what=what)
    return priority, at, tid
