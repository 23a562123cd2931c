"""stepstone: a durable workflow engine for Python whose replicas coordinate only through PostgreSQL.

    from stepstone import Workflow, Registry, StepContext, Retry, Client, Worker
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stepstone._sync_client import SyncClient
    from stepstone.authoring.workflow import CompensationContext, Registry, Retry, Signal, StepContext, Workflow
    from stepstone.client import Cancellation, Client, InstanceInfo
    from stepstone.core.limits import Limits
    from stepstone.core.plan import END
    from stepstone.runtime.worker import Worker, WorkerConfig

__version__ = "0.1.0"

__all__ = [
    "END",
    "Cancellation",
    "Client",
    "CompensationContext",
    "InstanceInfo",
    "Limits",
    "Registry",
    "Retry",
    "Signal",
    "StepContext",
    "SyncClient",
    "Worker",
    "WorkerConfig",
    "Workflow",
    "__version__",
]

# The public names are imported when first used (PEP 562), not with the package: every module of
# stepstone imports this package first, and the client, the worker and their models are about 0.4 s of
# a command line's start-up that `stepstone --version`, `stepstone db ...` and the worker's probes do
# not need.
_HOMES = {
    "SyncClient": "stepstone._sync_client",
    "CompensationContext": "stepstone.authoring.workflow",
    "Registry": "stepstone.authoring.workflow",
    "Retry": "stepstone.authoring.workflow",
    "Signal": "stepstone.authoring.workflow",
    "StepContext": "stepstone.authoring.workflow",
    "Workflow": "stepstone.authoring.workflow",
    "Cancellation": "stepstone.client",
    "Client": "stepstone.client",
    "InstanceInfo": "stepstone.client",
    "Limits": "stepstone.core.limits",
    "END": "stepstone.core.plan",
    "Worker": "stepstone.runtime.worker",
    "WorkerConfig": "stepstone.runtime.worker",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'stepstone' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
