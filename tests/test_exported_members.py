"""The public API is pinned: adding or removing a name is a deliberate change here."""

import stepstone
import stepstone.errors


def test_top_level_exports() -> None:
    assert sorted(stepstone.__all__) == sorted([
        "END", "Cancellation", "Client", "CompensationContext", "InstanceInfo", "Limits", "Registry", "Retry",
        "Signal", "StepContext",
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
        "BrokerMisconfigured", "BrokerUnavailable", "BusinessKeyInUse", "ConfigError", "Conflict", "DatabaseError",
        "DatabaseUnavailable", "DefinitionConflict",
        "DefinitionError", "DefinitionNotFound", "IdempotencyConflict", "InstanceNotFound", "InsufficientPrivilege",
        "InternalError", "InvalidDatabaseUrl", "InvalidInput", "InvalidState", "NotFound", "PayloadTooDeep",
        "PayloadTooLarge", "PositionNotFound", "SchemaNotReady", "SchemaTooNew", "StepstoneError", "UnknownBroker",
        "Unavailable", "UnknownSignal", "WaitTimeout", "ClientClosed",
        # external tasks (issue 13)
        "ExternalTaskNotFound", "LockExpired", "LockLost", "TaskEnded", "TaskLockRefused",
        # the definitions registry (issue 12)
        "DefinitionDrift", "DocumentInvalid", "DocumentTampered", "InvalidTransition", "MigrationRefused",
        "VersionNotAdmitted",
        # human tasks and messages (issue 11)
        "StateChangedSinceReview", "TaskHeld", "TaskNotFound", "TaskNotOpen", "TaskNotPermitted", "TaskRefused",
        "UnknownDecision", "OpenSignalLimit", "TaskFilterNotFound",
        # a retry of a child its parent no longer awaits
        "ChildNotAwaited",
    ])


def test_external_exports() -> None:
    import stepstone.external  # noqa: PLC0415 - the module under test

    assert sorted(stepstone.external.__all__) == sorted([
        "BusinessError", "ExternalTaskNotFound", "ExternalTasks", "ExternalWorker", "LockExpired", "LockLost",
        "LockedTask", "TaskAnswer", "TaskEnded",
        "TaskLockRefused",
    ])


def test_api_exports() -> None:
    """The API package's names are imported on first use (PEP 562): each one still resolves."""
    import stepstone.api  # noqa: PLC0415 - the module under test

    assert sorted(stepstone.api.__all__) == sorted([
        "ALL_SCOPES", "API_PREFIX", "NO_AUTH", "ROLES", "ROUTERS", "ApiContext", "Authenticate", "Principal",
        "TokenAuth", "context_on", "create_app", "open_app",
    ])
    for name in stepstone.api.__all__:
        assert getattr(stepstone.api, name) is not None, name
    assert set(dir(stepstone.api)) >= set(stepstone.api.__all__)
