"""Prometheus metrics of a worker (the `prometheus` extra): one `stepstone_` prefix, `_total` counters,
`_seconds` histograms, labels by workflow, step and outcome, never by instance.

    stepstone_steps_total{workflow,step,outcome}       handler runs: ok, failed, crashed
    stepstone_step_duration_seconds{workflow,step}     handler run time
    stepstone_commits_total{outcome,settle}            fenced commits: ok, conflict, fenced, error
    stepstone_commit_duration_seconds                  commit round trip
    stepstone_fenced_commits_total                     commits refused on a stale token
    stepstone_retries_total                            step attempts put back for a retry
    stepstone_dead_letters_total                       commands dead-lettered (instance FAILED)
    stepstone_claims_total{workflow,kind}              commands claimed
    stepstone_lease_expiries_total{workflow}           commands claimed again after a claim that never settled
    stepstone_start_to_first_step_seconds{workflow}    from the start's commit to its first claim (db clock)
    stepstone_commands{state}                          queue depth by state (sampled from the database)
    stepstone_oldest_pending_seconds                   how long the oldest runnable command has waited
                                                       (of those a live worker can take, below)
    stepstone_stranded_commands                        commands routed to a plan no worker served lately
    stepstone_oldest_stranded_seconds                  how long the oldest runnable one of those has waited
    stepstone_outbox_pending                           events not yet published
    stepstone_outbox_lag_seconds                       age of the oldest unpublished event

The sampled gauges come from one statement that only one worker at a time runs (an advisory lock);
the others keep their last sample.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from stepstone.runtime import observe

__all__ = ["WorkerMetrics"]

_STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_STATES = ("PENDING", "DEFERRED", "CLAIMED", "PARKED", "DEAD")


class WorkerMetrics:
    """The metrics of this process, on their own registry; `install()` starts recording the worker's steps."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.steps = Counter("stepstone_steps", "Step handler runs.", ["workflow", "step", "outcome"], registry=r)
        self.step_seconds = Histogram("stepstone_step_duration_seconds", "Step handler run time.",
                                      ["workflow", "step"], buckets=_STEP_BUCKETS, registry=r)
        self.commits = Counter("stepstone_commits", "Fenced commits.", ["outcome", "settle"], registry=r)
        self.commit_seconds = Histogram("stepstone_commit_duration_seconds", "Commit round trip.",
                                        buckets=_STEP_BUCKETS, registry=r)
        self.fenced = Counter("stepstone_fenced_commits", "Commits refused on a stale token.", registry=r)
        self.retries = Counter("stepstone_retries", "Step attempts put back for a retry.", registry=r)
        self.dead = Counter("stepstone_dead_letters", "Commands dead-lettered.", registry=r)
        self.claims = Counter("stepstone_claims", "Commands claimed.", ["workflow", "kind"], registry=r)
        self.expiries = Counter("stepstone_lease_expiries", "Commands claimed again after an unsettled claim.",
                                ["workflow"], registry=r)
        self.first = Histogram("stepstone_start_to_first_step_seconds", "From start to the first claim.",
                               ["workflow"], buckets=_STEP_BUCKETS, registry=r)
        self.queue = Gauge("stepstone_commands", "Commands by state (sampled).", ["state"], registry=r)
        self.oldest = Gauge("stepstone_oldest_pending_seconds", "Wait of the oldest runnable command (sampled).",
                            registry=r)
        self.stranded = Gauge("stepstone_stranded_commands",
                              "Commands routed to a plan no worker served in the last 5 minutes (sampled).", registry=r)
        self.stranded_oldest = Gauge("stepstone_oldest_stranded_seconds",
                                     "Wait of the oldest runnable command no worker can take (sampled).", registry=r)
        self.outbox = Gauge("stepstone_outbox_pending", "Unpublished outbox events (sampled).", registry=r)
        self.outbox_lag = Gauge("stepstone_outbox_lag_seconds", "Age of the oldest unpublished event (sampled).",
                                registry=r)

    # -- observe.Recorder ------------------------------------------------------------------------

    def step(self, workflow: str, step: str, seconds: float, outcome: str) -> None:
        self.steps.labels(workflow, step, outcome).inc()
        self.step_seconds.labels(workflow, step).observe(seconds)

    def commit(self, outcome: str, settle: str, seconds: float) -> None:
        self.commits.labels(outcome, settle).inc()
        self.commit_seconds.observe(seconds)
        if outcome == "fenced":
            self.fenced.inc()
        elif outcome == "ok" and settle == "RETRY":
            self.retries.inc()
        elif outcome == "ok" and settle == "DEAD":
            self.dead.inc()

    def claimed(self, workflow: str, kind: str, reclaimed: bool) -> None:
        self.claims.labels(workflow, kind).inc()
        if reclaimed:
            self.expiries.labels(workflow).inc()

    def first_step(self, workflow: str, seconds: float) -> None:
        self.first.labels(workflow).observe(seconds)

    # -- the rest --------------------------------------------------------------------------------

    def install(self) -> WorkerMetrics:
        observe.add_recorder(self)
        return self

    def uninstall(self) -> None:
        observe.remove_recorder(self)

    def record_sample(self, sample: dict[str, Any]) -> None:
        """Set the sampled gauges from `ObservingStore.sample()`."""
        states = sample.get("states") or {}
        for state in _STATES:
            self.queue.labels(state).set(float(states.get(state, 0)))
        self.oldest.set(float(sample.get("oldest_pending_seconds") or 0.0))
        self.stranded.set(float(sample.get("stranded_commands") or 0))
        self.stranded_oldest.set(float(sample.get("oldest_stranded_seconds") or 0.0))
        self.outbox.set(float(sample.get("outbox_pending") or 0))
        self.outbox_lag.set(float(sample.get("outbox_oldest_seconds") or 0.0))

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return generate_latest(self.registry)
