"""stepstone: a durable workflow engine for Python whose replicas coordinate only through PostgreSQL.

    from stepstone import Workflow, Registry, StepContext, Retry, Client, Worker
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstone._lazy_exports import lazy_exports

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


__getattr__, __dir__ = lazy_exports(__name__, globals(), _HOMES)
