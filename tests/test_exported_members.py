"""The public API is pinned: adding or removing a name is a deliberate change here."""

import stepstone
import stepstone.errors


def test_top_level_exports() -> None:
    assert sorted(stepstone.__all__) == sorted([
        "END", "Client", "InstanceInfo", "Limits", "Registry", "Retry", "Signal", "StepContext",
        "SyncClient", "Worker", "WorkerConfig", "Workflow", "__version__",
    ])
    for name in stepstone.__all__:
        assert hasattr(stepstone, name), name


def test_every_error_descends_from_the_root() -> None:
    for name in stepstone.errors.__all__:
        cls = getattr(stepstone.errors, name)
        assert issubclass(cls, stepstone.errors.StepstoneError), name


def test_error_exports() -> None:
    assert sorted(stepstone.errors.__all__) == sorted([
        "BrokerUnavailable", "BusinessKeyInUse", "ConfigError", "Conflict", "DatabaseError", "DatabaseUnavailable",
        "DefinitionConflict",
        "DefinitionError", "DefinitionNotFound", "IdempotencyConflict", "InstanceNotFound", "InsufficientPrivilege",
        "InternalError", "InvalidDatabaseUrl", "InvalidInput", "InvalidState", "NotFound", "PayloadTooDeep",
        "PayloadTooLarge", "PositionNotFound", "SchemaNotReady", "SchemaTooNew", "StepstoneError", "UnknownBroker",
        "Unavailable", "UnknownSignal", "WaitTimeout",
        "StateChangedSinceReview", "TaskHeld", "TaskNotFound", "TaskNotOpen", "TaskNotPermitted", "TaskRefused",
        "UnknownDecision", "OpenSignalLimit",
    ])
