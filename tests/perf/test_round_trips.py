"""Round trips on the hot path: at most one statement per step commit, one per claimed batch.

A step commit is either a `commit` statement of its own or one item of a `commit_many` statement
(group commit: the commits that queued while the previous one was in flight).

Counted by wrapping the store's statement methods (`PostgresStore._fetch/_fetchrow/_fetchval`)
while a running worker (its real claim loop) takes N three-step workflows to completion.
"""

from __future__ import annotations

from typing import Any

from stepstone.bench.common import StatementLog
from stepstone.bench.workflows import registry, three
from stepstone.client import Client
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.port import Claim
from stepstone.store.postgres import PostgresStore

N = 24
STEPS = 3
HOT_PATH = {"claim", "commit", "commit_many", "next_available", "renew"}
STARTUP = {"register_definition", "definition_hash"}  # worker.start() records its plans once
BACKGROUND = {"statistics_due"}  # until the tables have statistics, a look every few seconds


async def test_one_statement_per_step_commit_and_per_claimed_batch(database_url: str) -> None:
    store = await PostgresStore.open(database_url, max_size=12)
    try:
        client = Client(store, registry)
        for _ in range(N):
            await client.start(three, {})
        worker = Worker(store, registry, WorkerConfig(concurrency=8, worker_id="rt"))
        await worker.register()
        stats = StatementLog(store)
        batches: list[int] = []
        claim_calls: list[int] = []
        inner = store.claim

        async def claim(*args: Any) -> list[Claim]:
            claim_calls.append(1)
            found = await inner(*args)
            if found:
                batches.append(len(found))
            return found

        store.claim = claim  # type: ignore[method-assign]
        grouped: list[int] = []
        inner_many = store.commit_many

        async def commit_many(requests: list[Any], **kwargs: Any) -> Any:
            grouped.append(len(requests))
            return await inner_many(requests, **kwargs)

        store.commit_many = commit_many  # type: ignore[method-assign]
        await worker.start()
        try:
            await worker.events.wait_until(lambda: worker.events.commits >= N * STEPS, timeout=60)
        finally:
            await worker.stop()
    finally:
        await store.close()

    names = {name for name, _ in stats.calls} - STARTUP - BACKGROUND
    assert names <= HOT_PATH, f"statements off the hot path while running: {names - HOT_PATH}"
    assert worker.events.commits == N * STEPS
    assert stats.count("commit") + sum(grouped) == N * STEPS, "every step commit went out exactly once"
    assert stats.count("commit_many") == len(grouped), "a group commit is one statement"
    assert stats.count("commit") + stats.count("commit_many") <= N * STEPS, "at most one statement per step commit"
    assert sum(batches) == N, "every START was claimed once"
    # A batch of several claims is one statement: claim statements that found work == batches.
    assert len(batches) < N, f"claims were not batched: {batches}"
    # One statement per claim call, whether it found a batch or nothing.
    assert stats.count("claim") == len(claim_calls), (stats.count("claim"), len(claim_calls))
