"""stepstone: a durable workflow engine for Python whose replicas coordinate only through PostgreSQL.

    from stepstone import Workflow, Registry, StepContext, Retry, Client, Worker
"""

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
