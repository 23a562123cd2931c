"""External tasks: outside workers, in any language, take part in workflows through `external` steps.

`ExternalTasks` is the Python client (on the database), `ExternalWorker` runs handlers per topic on
it; `stepstone external serve` offers the same operations over HTTP (`stepstone.external.http`, extra
``stepstone[external]``). See docs/external-tasks.md.
"""

from __future__ import annotations

from stepstone.errors import ExternalTaskNotFound, LockExpired, LockLost, TaskEnded, TaskLockRefused
from stepstone.external.tasks import ExternalTasks, LockedTask, TaskAnswer
from stepstone.external.worker import BusinessError, ExternalWorker

__all__ = [
    "BusinessError",
    "ExternalTaskNotFound",
    "ExternalTasks",
    "ExternalWorker",
    "LockExpired",
    "LockLost",
    "LockedTask",
    "TaskAnswer",
    "TaskEnded",
    "TaskLockRefused",
]
