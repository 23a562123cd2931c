"""A worker's and an outbox relay's settings are checked when they are made (`core.bounds`): a worker
with a lease of inf seconds started, then failed every claim with "interval out of range"; a relay's
batch of 0 or a max_attempts past int4 reached the store. Operations' batch sizes are checked as the
CLI's --batch-size is: a retention sweep of batch 0 never finished."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest

from stepstone.errors import ConfigError, InvalidInput
from stepstone.ops import Operations
from stepstone.outbox.relay import RelayConfig
from stepstone.runtime.worker import WorkerConfig
from stepstone.store.postgres import PostgresStore

BAD_SECONDS = [0, -1.0, math.inf, math.nan, 1e300, True, "30"]


@pytest.mark.parametrize("field", ["lease_seconds", "poll_interval", "heartbeat_seconds", "schedule_interval",
                                   "statistics_interval"])
@pytest.mark.parametrize("value", BAD_SECONDS)
def test_a_worker_refuses_seconds_it_cannot_use(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        WorkerConfig(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "value"), [
    ("concurrency", 0), ("concurrency", 10_001), ("concurrency", 2.5), ("max_claims", 0), ("max_claims", 2**31),
    ("drain_timeout", -1), ("drain_timeout", math.inf), ("min_wake_interval", math.nan),
])
def test_a_worker_refuses_counts_and_waits_out_of_range(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        WorkerConfig(**{field: value})  # type: ignore[arg-type]


def test_the_smallest_settings_the_tests_use_are_fine() -> None:
    config = WorkerConfig(concurrency=1, lease_seconds=0.3, poll_interval=0.05, heartbeat_seconds=0.2,
                          drain_timeout=0, min_wake_interval=0, max_claims=2)
    with pytest.raises(ConfigError, match="lease_seconds"):
        replace(config, lease_seconds=math.inf)  # replace makes the settings anew, so it checks them too
    RelayConfig(batch_size=1, max_attempts=1, lease_seconds=0.5, poll_interval=0.05, retry_base=0, retry_max=0)


@pytest.mark.parametrize(("field", "value"), [
    ("batch_size", 0), ("batch_size", 100_001), ("max_attempts", 0), ("max_attempts", 2**31),
    ("lease_seconds", math.inf), ("poll_interval", 0), ("retry_max", math.nan), ("retry_max", -1),
    ("retry_base", -1),
])
def test_a_relay_refuses_settings_out_of_range(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        RelayConfig(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("batch_size", [0, -1, 2**63, True])
async def test_operations_refuse_a_batch_size_the_cli_would(database_url: str, batch_size: int) -> None:
    store = await PostgresStore.open(database_url)
    try:
        ops = Operations.on(store)
        for run in (lambda: ops.retention_run(batch_size=batch_size), lambda: ops.retry([], batch_size=batch_size),
                    lambda: ops.cancel([], batch_size=batch_size)):
            with pytest.raises(InvalidInput, match="batch_size"):
                await asyncio.wait_for(run(), 60)  # a sweep of batch 0 never ended: fail, do not hang
    finally:
        await store.close()
