"""The one exception hierarchy of stepstone; driver errors are translated into it at the store boundary.

    StepstoneError                  root: anything stepstone raises on purpose
    ├── ConfigError                 permanent until the configuration, the setup or the code changes
    │   ├── InvalidDatabaseUrl      the database URL cannot be parsed (url, redacted)
    │   ├── UnknownBroker           no publisher for a broker URL's scheme, or its extra is not installed
    │   ├── BrokerMisconfigured     the broker refuses the publisher's setup (events are held, not failed)
    │   ├── DefinitionError         a workflow definition that cannot become a plan
    │   ├── InsufficientPrivilege * the role may not do what stepstone needs
    │   ├── SchemaNotReady        * the schema is missing or behind: run `stepstone db migrate` (schema)
    │   └── SchemaTooNew          * the schema history has versions this stepstone does not know and lacks one it ships
    ├── DatabaseError               a problem talking to or with PostgreSQL (and the * classes above)
    │   └── DatabaseUnavailable   + transient: unreachable, refused, connection lost (host, port)
    ├── Unavailable                 transient: a dependency cannot be reached now (and the + class)
    │   └── BrokerUnavailable       the outbox relay cannot reach its broker (events wait)
    ├── NotFound                    the thing named does not exist
    │   ├── InstanceNotFound        (instance_id)
    │   ├── PositionNotFound        (instance_id, position): no such branch
    │   ├── DefinitionNotFound      (definition_id, version)
    │   ├── ExternalTaskNotFound    (task_id)
    │   ├── TaskFilterNotFound      (name, user, scope): no saved inbox filter of that name
    │   └── TaskNotFound            (task_id)
    ├── Conflict                    the request contradicts what is stored
    │   ├── DefinitionConflict      same id and version registered with a different structure
    │   │   └── DefinitionDrift     a plan hash changed without a version bump (refused, never re-pinned)
    │   ├── VersionNotAdmitted      pin admission: the version is not AVAILABLE (deprecated, retired, ...)
    │   ├── InvalidTransition       a registry lifecycle change the rules forbid (definition_id, version)
    │   ├── DocumentTampered        a stored document's text no longer matches its SHA-256 digest
    │   ├── MigrationRefused        an in-flight migration that would leave the instance unreachable
    │   ├── IdempotencyConflict     a key reused with other input (instance_id or command_id)
    │   ├── BusinessKeyInUse        (instance_id of the holder)
    │   ├── InvalidState            the instance's status does not allow it (instance_id, status)
    │   │   └── ChildNotAwaited         a retry of a child its parent no longer awaits (parent_id, parent_status,
    │   │                               awaits: the child the parent's position awaits instead, or None)
    │   ├── TaskLockRefused         an external task's answer fenced out (task_id, reason, status):
    │   │   ├── LockLost                the token does not hold the task (another worker has it)
    │   │   ├── LockExpired             the lock ran out before the answer
    │   │   └── TaskEnded               the task was answered already or its position moved on
    │   ├── OpenSignalLimit         the instance holds as many open signals as allowed (instance_id, limit)
    │   └── TaskRefused             a task operation refused (task_id, status, assignee, completion)
    │       ├── TaskNotOpen         COMPLETING, COMPLETED, CANCELLED or EXPIRED (completion: the winner's)
    │       ├── TaskHeld            claimed by someone else; claim never steals unless forced
    │       ├── TaskNotPermitted    the actor is neither assignee, owner nor candidate (actor)
    │       └── StateChangedSinceReview  the data shown changed since it was reviewed (changed, current_version)
    ├── InvalidInput                refused before anything is stored (what)
    │   ├── PayloadTooLarge / PayloadTooDeep  (what, reason)
    │   ├── UnknownSignal           (name): the pinned definition declares no such signal
    │   ├── UnknownDecision         (decision, allowed): the task declares no such decision
    │   └── DocumentInvalid         a workflow document that fails its schema or names an unknown handler
    ├── WaitTimeout                 wait_for gave up before the instance ended (instance_id, status)
    ├── ClientClosed                a call after close() on a Client, a SyncClient or their store (also a
    │                               RuntimeError): a mistake in the caller, not an outage; open another
    └── InternalError               a bug in stepstone: an invariant did not hold (please report it)

The type alone says what a caller can do: fix the configuration (ConfigError), retry later
(Unavailable), look the thing up again (NotFound), reconcile (Conflict), change the request
(InvalidInput), wait longer (WaitTimeout), stop using what it closed (ClientClosed) or report a bug
(InternalError). The classes marked * are both a ConfigError and a DatabaseError. Messages are one
line and never contain a password.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stepstone.core.limits import PayloadRejected

__all__ = [
    "BrokerMisconfigured",
    "BrokerUnavailable",
    "BusinessKeyInUse",
    "ChildNotAwaited",
    "ClientClosed",
    "ConfigError",
    "Conflict",
    "DatabaseError",
    "DatabaseUnavailable",
    "DefinitionConflict",
    "DefinitionDrift",
    "DefinitionError",
    "DefinitionNotFound",
    "DocumentInvalid",
    "DocumentTampered",
    "ExternalTaskNotFound",
    "IdempotencyConflict",
    "InstanceNotFound",
    "InsufficientPrivilege",
    "InternalError",
    "InvalidDatabaseUrl",
    "InvalidInput",
    "InvalidState",
    "InvalidTransition",
    "LockExpired",
    "LockLost",
    "MigrationRefused",
    "NotFound",
    "OpenSignalLimit",
    "PayloadTooDeep",
    "PayloadTooLarge",
    "PositionNotFound",
    "SchemaNotReady",
    "SchemaTooNew",
    "StateChangedSinceReview",
    "StepstoneError",
    "TaskEnded",
    "TaskFilterNotFound",
    "TaskHeld",
    "TaskLockRefused",
    "TaskNotFound",
    "TaskNotOpen",
    "TaskNotPermitted",
    "TaskRefused",
    "Unavailable",
    "UnknownBroker",
    "UnknownDecision",
    "UnknownSignal",
    "VersionNotAdmitted",
    "WaitTimeout",
]


class StepstoneError(Exception):
    """Root of every error stepstone raises on purpose."""


class ConfigError(StepstoneError):
    """The configuration in effect is invalid (e.g. a schema name that is not a safe identifier).

    Permanent: retrying gives the same error until the configuration, the database setup or the
    workflow code changes.
    """


class InvalidDatabaseUrl(ConfigError):
    """The database URL cannot be parsed; `url` is the URL with any secret masked."""

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = url


class UnknownBroker(ConfigError):
    """No publisher is registered for the broker URL's scheme, or the extra that provides it is missing."""


class BrokerMisconfigured(ConfigError):
    """The broker refuses what the publisher sets up before publishing (a NATS stream whose subjects overlap
    another stream's, a RabbitMQ exchange of that name of another type, a right the broker's user lacks).
    Permanent until the broker or the URL changes: the relay holds the batch unpublished, counting no
    attempt, says so, and tries again after a backoff."""


class Unavailable(StepstoneError):
    """Transient: something stepstone depends on cannot be reached now; the same call may pass later."""


class BrokerUnavailable(Unavailable):
    """The relay's broker cannot be reached; the batch is released unpublished and no attempt is counted."""


class DatabaseError(StepstoneError):
    """Base for problems talking to or with PostgreSQL."""


class DatabaseUnavailable(DatabaseError, Unavailable):
    """The database cannot be reached now (refused, unknown host, connection lost): may pass on retry."""

    def __init__(self, message: str, *, host: str | None = None, port: int | None = None) -> None:
        super().__init__(message)
        self.host = host
        self.port = port


class InsufficientPrivilege(DatabaseError, ConfigError):
    """The database role lacks a privilege stepstone needs (e.g. CREATE on the database)."""


class SchemaNotReady(DatabaseError, ConfigError):
    """The schema is not set up, or has pending migrations; nothing was migrated implicitly."""

    def __init__(self, message: str, *, schema: str | None, pending: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.schema = schema
        self.pending = pending


class SchemaTooNew(DatabaseError, ConfigError):
    """The schema history records migrations newer than this stepstone ships while one it ships is missing
    (no release's schema); nothing was applied. A newer release's schema with every shipped migration is used."""

    def __init__(self, message: str, *, unknown_versions: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.unknown_versions = unknown_versions


class DefinitionError(ConfigError):
    """A workflow definition that cannot become a plan; the message names every problem."""


class NotFound(StepstoneError):
    """The instance, definition or other thing named does not exist."""


class InstanceNotFound(NotFound):
    def __init__(self, instance_id: str) -> None:
        super().__init__(f"no instance {instance_id}")
        self.instance_id = instance_id


class PositionNotFound(NotFound):
    def __init__(self, instance_id: str, position: str) -> None:
        super().__init__(f"instance {instance_id} has no position {position!r}")
        self.instance_id = instance_id
        self.position = position


class DefinitionNotFound(NotFound):
    def __init__(self, definition_id: str, version: int | None = None, *, reason: str = "is registered here") -> None:
        which = f"{definition_id!r}" + (f" v{version}" if version is not None else "")
        super().__init__(f"no workflow definition {which} {reason}" if reason == "is registered here"
                         else f"workflow definition {which} {reason}")
        self.definition_id = definition_id
        self.version = version


class ExternalTaskNotFound(NotFound):
    def __init__(self, task_id: str) -> None:
        super().__init__(f"no external task {task_id}")
        self.task_id = task_id


class Conflict(StepstoneError):
    """The request contradicts what is already stored."""


class DefinitionConflict(Conflict):
    """The same definition id and version is already registered with a different plan hash."""

    def __init__(self, message: str, *, definition_id: str, version: int) -> None:
        super().__init__(message)
        self.definition_id = definition_id
        self.version = version


class IdempotencyConflict(Conflict):
    """A start idempotency key or signal dedup key was reused with different input, or a task operation's key
    with another request or by another actor."""

    def __init__(self, message: str, *, instance_id: str, command_id: int | None = None) -> None:
        super().__init__(message)
        self.instance_id = instance_id
        self.command_id = command_id


class BusinessKeyInUse(Conflict):
    def __init__(self, business_key: str, instance_id: str) -> None:
        super().__init__(f"business key {business_key!r} is already used by instance {instance_id}")
        self.business_key = business_key
        self.instance_id = instance_id


class InvalidState(Conflict):
    """The instance's status does not allow the operation (e.g. retry of a running instance)."""

    def __init__(self, message: str, *, instance_id: str, status: str) -> None:
        super().__init__(message)
        self.instance_id = instance_id
        self.status = status


def parent_went_on(instance_id: str, parent_id: str | None, parent_status: str | None) -> InvalidState:
    """The refusal of a retry of a child stopped at COMPENSATION_FAILED whose parent a replay took forward
    after its saga asked the child to compensate: resuming would undo the child under that parent."""
    return InvalidState(
        f"instance {instance_id} is not retried: its parent {parent_id} asked it to compensate, then went forward "
        f"(replayed; it is {parent_status}), and a retry would undo this child under it. Replay the child to take "
        "it forward too, or cancel it to leave it as it is",
        instance_id=instance_id, status="COMPENSATION_FAILED",
    )


def child_report_pending(instance_id: str, parent_id: str | None, parent_status: str | None) -> InvalidState:
    """The refusal of a retry of a FAILED child whose failure report its parent, still awaiting it, has not
    applied yet (store/schema.sql, version 89): applied, it may take the parent past the child."""
    return InvalidState(
        f"instance {instance_id} is not retried: its parent {parent_id} ({parent_status}) has not yet applied the "
        "report of its failure, which may take the parent past it (to the child step's on_failure, or into "
        "compensation), and then nothing would take this child's result. Nothing changed. Retry it once the "
        "parent has applied the report: a parent that failed at that step still awaits the child",
        instance_id=instance_id, status="FAILED",
    )


class ChildNotAwaited(InvalidState):
    """A retry of a FAILED child refused: its parent no longer awaits it (replayed to another visit, gone on
    to on_failure, ended, compensating, its branch closed, or going on without its failed branch), so its
    steps would run again for a result nothing takes. Nothing changed. `awaits` is the child the parent's
    position awaits (or started) instead."""

    def __init__(self, message: str, *, instance_id: str, parent_id: str | None, parent_status: str | None,
                 awaits: str | None) -> None:
        super().__init__(message, instance_id=instance_id, status="FAILED")
        self.parent_id = parent_id
        self.parent_status = parent_status
        self.awaits = awaits


def child_not_awaited(instance_id: str, parent: Mapping[str, Any]) -> ChildNotAwaited:
    """The refusal of a retry of a child its parent no longer awaits, from the parent as `parent_of_child`
    reads it (store/schema.sql, version 83): what the parent did instead and what the operator can do."""
    parent_id = str(parent["parent_id"]) if parent.get("parent_id") else None
    status, awaits = parent.get("parent_status"), parent.get("awaits")
    where = "" if not parent.get("parent_position") else f" in branch {parent['parent_position']}"
    if status is None:
        why = f"its parent {parent_id} no longer exists"
    elif status in ("COMPLETED", "CANCELLED", "COMPENSATED", "TIMED_OUT"):
        why = f"its parent {parent_id} has ended ({status})"
    elif status in ("COMPENSATING", "COMPENSATION_FAILED"):
        why = f"its parent {parent_id} is {status}, undoing its steps"
    elif parent.get("position_visit") != parent.get("child_visit"):
        instead = f", awaiting child {awaits} instead" if awaits else ""
        why = (f"its parent {parent_id} has moved past the step visit that started it (visit "
               f"{parent.get('child_visit')}{where}; it is {status} at step {parent.get('position_step')!r}, visit "
               f"{parent.get('position_visit')}{instead})")
    elif parent.get("position_status") == "FAILED":
        why = (f"its parent {parent_id} ({status}) goes on without the branch that started it "
               f"({parent.get('parent_position')}, which failed and which its join does not need)")
    else:
        why = f"its parent {parent_id} ({status}) closed the branch that started it ({parent.get('position_status')})"
    step = parent.get("child_step") or "STEP"
    return ChildNotAwaited(
        f"instance {instance_id} is not retried: {why}, so nothing takes this child's result and its steps would "
        "run again beside what the parent went on with. Nothing changed. Leave it FAILED, or run it anyway as an "
        f"instance of its own: stepstone replay --instance {instance_id} --from {step}",
        instance_id=instance_id, parent_id=parent_id, parent_status=status,
        awaits=str(awaits) if awaits else None)


class TaskLockRefused(Conflict):
    """An answer to an external task (extend, complete, fail, business error) was refused: the lock
    token given no longer holds the task. `reason` is lock_lost, lock_expired, not_open or not_awaited."""

    def __init__(self, message: str, *, task_id: str, reason: str, status: str | None) -> None:
        super().__init__(message)
        self.task_id = task_id
        self.reason = reason
        self.status = status


class LockLost(TaskLockRefused):
    """The token does not hold the task: it was never locked with it, or the lock moved to another worker."""


class LockExpired(TaskLockRefused):
    """The lock ran out before the answer arrived; fetch the task again."""


class TaskEnded(TaskLockRefused):
    """The task was answered already, or its position no longer waits for it (cancelled, moved on)."""


class InvalidInput(StepstoneError):
    """Input refused before anything was stored; `what` names the argument when known."""

    item: int | None = None
    """Of a batch's inputs (`start_many`): the refused one's position, 1-based (None otherwise)."""
    item_detail: str | None = None
    """Of a batch's inputs: what was refused in that input, without its position."""

    def __init__(self, message: str, *, what: str | None = None) -> None:
        super().__init__(message)
        self.what = what

    def in_batch(self, item: int, total: int) -> InvalidInput:
        """The same refusal (its type and fields kept), said of input `item` of `total`. The two batch
        fields are set on this copy alone, so a single refusal's fields (and the API's problem document
        built from them) stay as they were."""
        said = copy.copy(self)
        said.args = (f"item {item} of {total}: {self}",)
        said.item, said.item_detail = item, str(self)
        return said


class PayloadTooLarge(InvalidInput):
    """A payload, key or text longer than its limit; `reason` is the limit's kind ("too_large")."""

    def __init__(self, message: str, *, what: str | None = None, reason: str = "too_large") -> None:
        super().__init__(message, what=what)
        self.reason = reason


class PayloadTooDeep(InvalidInput):
    """A document nested deeper than the limit; `reason` is "too_deep"."""

    def __init__(self, message: str, *, what: str | None = None, reason: str = "too_deep") -> None:
        super().__init__(message, what=what)
        self.reason = reason


def refused(exc: PayloadRejected) -> InvalidInput:
    """The typed error of a value `Limits` refused (too large, too deep, or not storable)."""
    if exc.reason == "too_large":
        return PayloadTooLarge(str(exc), what=exc.what, reason=exc.reason)
    if exc.reason == "too_deep":
        return PayloadTooDeep(str(exc), what=exc.what, reason=exc.reason)
    return InvalidInput(str(exc), what=exc.what)


class UnknownSignal(InvalidInput):
    """A signal the instance's pinned version does not declare; with the pin when it is known (the
    definition's `scope`, `definition_id`, `version` and the names it `declared`)."""

    def __init__(self, name: str, instance_id: str | None, *, scope: str | None = None,
                 definition_id: str | None = None, version: int | None = None, declared: tuple[str, ...] = ()) -> None:
        if instance_id is None:  # no instance yet (start-or-signal): the workflow the call would start
            message = (f"workflow {definition_id!r} v{version} has no signal named {name!r} (it declares "
                       f"{', '.join(declared) or 'none'})")
        elif scope is None:
            message = f"instance {instance_id} has no signal named {name!r} in its definition"
        else:
            known = ", ".join(declared) or "none"
            message = (f"instance {instance_id} has no signal named {name!r} in its pinned version: workflow "
                       f"{definition_id!r} v{version} of scope {scope} declares {known}")
        super().__init__(message, what="signal name")
        self.name = name
        self.instance_id = instance_id
        self.scope = scope
        self.definition_id = definition_id
        self.version = version
        self.declared = declared


class WaitTimeout(StepstoneError):
    """`wait_for` gave up before the instance reached a final status."""

    def __init__(self, instance_id: str, status: str, timeout: float) -> None:
        super().__init__(f"instance {instance_id} is still {status} after {timeout:g} s")
        self.instance_id = instance_id
        self.status = status


class ClientClosed(StepstoneError, RuntimeError):
    """A call on a Client, a SyncClient or their store after close(): retrying cannot help (it is not
    DatabaseUnavailable); open another. A RuntimeError too, as using any closed resource is."""


class InternalError(StepstoneError):
    """A bug in stepstone: an invariant of the store or the engine did not hold. Please report it."""


class DefinitionDrift(DefinitionConflict):
    """A definition version whose plan hash changed without a version bump: refused, never re-pinned."""


class VersionNotAdmitted(Conflict):
    """Pin admission refused: the version is deprecated, retired, not yet published or not registered."""

    def __init__(self, message: str, *, definition_id: str = "", version: int | None = None) -> None:
        super().__init__(message)
        self.definition_id = definition_id
        self.version = version


class InvalidTransition(Conflict):
    """A registry lifecycle change the rules forbid (e.g. retiring a version that live instances pin)."""

    def __init__(self, message: str, *, definition_id: str = "", version: int | None = None) -> None:
        super().__init__(message)
        self.definition_id = definition_id
        self.version = version


class DocumentTampered(Conflict):
    """A stored document's text no longer matches the SHA-256 digest recorded with it."""


class MigrationRefused(Conflict):
    """An in-flight migration that would leave an instance unreachable or its state invalid."""

    def __init__(self, message: str, *, instance_id: str = "") -> None:
        super().__init__(message)
        self.instance_id = instance_id


class DocumentInvalid(InvalidInput):
    """A workflow document that fails its JSON Schema, its size limit, or names an unknown handler;
    `path` is the document path (e.g. ``steps[2].handler``), `line` and `column` 1-based when known (of
    the first problem). `problems` lists every problem found at that stage, each a dict of `path`,
    `line`, `column` and `message`: all of the schema's, of the unknown steps named, of the catalog's
    unknown names, or of the graph's rules."""

    def __init__(self, message: str, *, path: str = "", line: int | None = None, column: int | None = None,
                 problems: tuple[dict[str, Any], ...] = ()) -> None:
        super().__init__(message, what="document")
        self.path = path
        self.line = line
        self.column = column
        self.problems = problems or ({"path": path, "line": line, "column": column, "message": message},)


class TaskNotFound(NotFound):
    def __init__(self, task_id: str) -> None:
        super().__init__(f"no task {task_id}")
        self.task_id = task_id


class TaskRefused(Conflict):
    """A task operation refused, nothing changed: `status`, `assignee` and `completion` (the recorded
    completion: decision, actor, ...) say what the task is now."""

    def __init__(self, message: str, *, task_id: str, status: str, assignee: str | None = None,
                 completion: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.task_id = task_id
        self.status = status
        self.assignee = assignee
        self.completion = completion


class TaskNotOpen(TaskRefused):
    """The task is COMPLETING (a completion is pending), COMPLETED, CANCELLED or EXPIRED."""


class TaskHeld(TaskRefused):
    """Another user holds the task; claiming it needs an admin's force (which is recorded)."""


class TaskNotPermitted(TaskRefused):
    """The actor is neither the task's assignee, its owner nor a candidate (and no admin override)."""

    def __init__(self, message: str, *, task_id: str, status: str, actor: str | None,
                 assignee: str | None = None) -> None:
        super().__init__(message, task_id=task_id, status=status, assignee=assignee)
        self.actor = actor


class StateChangedSinceReview(TaskRefused):
    """A task that requires version stability: the completion names another version than the one
    shown, or a field shown changed since; `changed` names those fields."""

    def __init__(self, message: str, *, task_id: str, status: str, reviewed_version: int | None,
                 shown_version: int, changed: tuple[str, ...]) -> None:
        super().__init__(message, task_id=task_id, status=status)
        self.reviewed_version = reviewed_version
        self.shown_version = shown_version
        self.changed = changed


class UnknownDecision(InvalidInput):
    def __init__(self, decision: str, task_id: str, allowed: tuple[str, ...]) -> None:
        super().__init__(f"task {task_id} has no decision {decision!r} (it takes {', '.join(allowed)})",
                         what="decision")
        self.decision = decision
        self.task_id = task_id
        self.allowed = allowed


class OpenSignalLimit(Conflict):
    """An instance holds as many open signals and messages as it may (`limit`, the setting
    stepstone.max_open_signals, default 1000), or a (name, key) as many buffered messages: this one was
    refused and nothing of it was stored, no dedup key included."""

    def __init__(self, message: str, *, instance_id: str | None, limit: int) -> None:
        super().__init__(message)
        self.instance_id = instance_id
        self.limit = limit


class TaskFilterNotFound(NotFound):
    """No saved inbox filter of that name for that user in that scope."""

    def __init__(self, name: str, *, user: str, scope: str) -> None:
        super().__init__(f"user {user} has no saved task filter {name!r} in scope {scope}")
        self.name = name
        self.user = user
        self.scope = scope
