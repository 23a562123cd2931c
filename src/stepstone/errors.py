"""The one exception hierarchy of stepstone; driver errors are translated into it at the store boundary.

    StepstoneError                  root: anything stepstone raises on purpose
    ├── ConfigError                 bad configuration (flag, env var, pyproject.toml)
    │   └── UnknownBroker           no publisher for a broker URL's scheme, or its extra is not installed
    ├── DatabaseError               a problem talking to or with PostgreSQL
    │   ├── DatabaseUnavailable     unreachable, refused, malformed URL or transient (host, port)
    │   ├── InsufficientPrivilege   the role may not do what stepstone needs
    │   └── SchemaTooNew            the schema history has versions this stepstone does not know
    ├── BrokerUnavailable           the outbox relay cannot reach its broker (events wait, none is lost)
    ├── DefinitionError             a workflow definition that cannot become a plan
    │   └── DefinitionConflict      same id and version registered with a different structure
    ├── NotFound                    the thing named does not exist
    │   ├── InstanceNotFound        (instance_id)
    │   ├── PositionNotFound        (instance_id, position): no such branch
    │   └── DefinitionNotFound      (definition_id, version)
    ├── Conflict                    the request contradicts what is stored
    │   ├── IdempotencyConflict     a key reused with other input (instance_id or command_id)
    │   ├── BusinessKeyInUse        (instance_id of the holder)
    │   └── InvalidState            the instance's status does not allow it (instance_id, status)
    ├── InvalidInput                rejected before anything is stored
    │   ├── PayloadTooLarge / PayloadTooDeep
    │   └── UnknownSignal           (name): the pinned definition declares no such signal
    └── WaitTimeout                 wait_for gave up before the instance ended (instance_id, status)

A caller can tell configuration problems, transient database failures and refusals apart by class.
Messages are one line and never contain a password.
"""

from __future__ import annotations

__all__ = [
    "BrokerUnavailable",
    "BusinessKeyInUse",
    "ConfigError",
    "Conflict",
    "DatabaseError",
    "DatabaseUnavailable",
    "DefinitionConflict",
    "DefinitionError",
    "DefinitionNotFound",
    "IdempotencyConflict",
    "InstanceNotFound",
    "InsufficientPrivilege",
    "InvalidInput",
    "InvalidState",
    "NotFound",
    "PayloadTooDeep",
    "PayloadTooLarge",
    "PositionNotFound",
    "SchemaTooNew",
    "StepstoneError",
    "UnknownBroker",
    "UnknownSignal",
    "WaitTimeout",
]


class StepstoneError(Exception):
    """Root of every error stepstone raises on purpose."""


class ConfigError(StepstoneError):
    """The configuration in effect is invalid (e.g. a schema name that is not a safe identifier)."""


class UnknownBroker(ConfigError):
    """No publisher is registered for the broker URL's scheme, or the extra that provides it is missing."""


class BrokerUnavailable(StepstoneError):
    """The relay's broker cannot be reached; the batch is released unpublished and no attempt is counted."""


class DatabaseError(StepstoneError):
    """Base for problems talking to or with PostgreSQL."""


class DatabaseUnavailable(DatabaseError):
    """The database cannot be reached (refused, unknown host, malformed URL, connection lost)."""

    def __init__(self, message: str, *, host: str | None = None, port: int | None = None) -> None:
        super().__init__(message)
        self.host = host
        self.port = port


class InsufficientPrivilege(DatabaseError):
    """The database role lacks a privilege stepstone needs (e.g. CREATE on the database)."""


class SchemaTooNew(DatabaseError):
    """The schema history records migrations newer than this stepstone ships; nothing was applied."""

    def __init__(self, message: str, *, unknown_versions: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.unknown_versions = unknown_versions


class DefinitionError(StepstoneError):
    """A workflow definition that cannot become a plan; the message names every problem."""


class DefinitionConflict(DefinitionError):
    """The same definition id and version is already registered with a different plan hash."""

    def __init__(self, message: str, *, definition_id: str, version: int) -> None:
        super().__init__(message)
        self.definition_id = definition_id
        self.version = version


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
    def __init__(self, definition_id: str, version: int | None = None) -> None:
        which = f"{definition_id!r}" + (f" v{version}" if version is not None else "")
        super().__init__(f"no workflow definition {which} is registered here")
        self.definition_id = definition_id
        self.version = version


class Conflict(StepstoneError):
    """The request contradicts what is already stored."""


class IdempotencyConflict(Conflict):
    """A start idempotency key or signal dedup key was reused with different input."""

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


class InvalidInput(StepstoneError):
    """Input rejected before anything was stored."""


class PayloadTooLarge(InvalidInput):
    pass


class PayloadTooDeep(InvalidInput):
    pass


class UnknownSignal(InvalidInput):
    def __init__(self, name: str, instance_id: str) -> None:
        super().__init__(f"instance {instance_id} has no signal named {name!r} in its definition")
        self.name = name
        self.instance_id = instance_id


class WaitTimeout(StepstoneError):
    """`wait_for` gave up before the instance reached a final status."""

    def __init__(self, instance_id: str, status: str, timeout: float) -> None:
        super().__init__(f"instance {instance_id} is still {status} after {timeout:g} s")
        self.instance_id = instance_id
        self.status = status
