"""A worker's settings (`WorkerConfig`) and the counters it bumps for tests and probes (`WorkerEvents`).
`stepstone.runtime.worker` re-exports both."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stepstone.core.bounds import check_count, check_seconds
from stepstone.core.limits import MAX_INT4
from stepstone.runtime.counters import Counters

__all__ = ["MAX_CONCURRENCY", "WorkerConfig", "WorkerEvents", "default_worker_id"]

MAX_CONCURRENCY = 10_000
"""A worker's slots at most (each holds a lease and, while its step runs, a task or a thread)."""


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class WorkerConfig:
    concurrency: int = 8
    lease_seconds: float = 30.0
    poll_interval: float = 1.0
    max_claims: int = 5
    drain_timeout: float = 10.0
    # Any role that can connect may NOTIFY the wake-up channel: after a claim that found nothing, claim
    # again at most once per this interval however many notifications arrive.
    min_wake_interval: float = 0.005
    # How often the worker says which pins it serves (the stranded report reads it; see runtime/serving.py).
    heartbeat_seconds: float = 10.0
    # How often the worker looks for due schedules at most (it also wakes for the next known tick).
    schedule_interval: float = 1.0
    # How often a worker looks whether the engine's tables still lack statistics (until they have them).
    statistics_interval: float = 2.0
    worker_id: str = field(default_factory=default_worker_id)
    on_compensation_failed: Callable[[dict[str, Any]], Any] | None = None
    """The alert hook (sync or async): called once, by the worker whose commit gave a compensation up,
    with instance_id, workflow, step, compensation, attempts and last_error (`core.saga`). The outbox
    event `stepstone.compensation_failed` carries the same in that commit."""

    def __post_init__(self) -> None:
        check_count("WorkerConfig", "concurrency", self.concurrency, 1, MAX_CONCURRENCY)
        check_count("WorkerConfig", "max_claims", self.max_claims, 1, MAX_INT4)
        for what in ("lease_seconds", "poll_interval", "heartbeat_seconds", "schedule_interval",
                     "statistics_interval"):
            check_seconds("WorkerConfig", what, getattr(self, what))
        for what in ("drain_timeout", "min_wake_interval"):
            check_seconds("WorkerConfig", what, getattr(self, what), zero=True)


@dataclass
class WorkerEvents(Counters):
    """Counters tests can wait on (`wait_until`), instead of sleeping."""

    claims: int = 0
    commits: int = 0
    fenced: int = 0
    released: int = 0
    deferred: int = 0
    crashed: int = 0
    conflicts: int = 0
    lease_rounds: int = 0
    """Rounds of the lease loop done (renewing what the worker holds, or finding nothing to renew)."""
