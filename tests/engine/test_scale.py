"""Several worker processes on one database, and many waiting instances that hold no worker slot."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stepstone.store.postgres import PostgresStore
from stepstone.testing import Engine
from tests.engine.conftest import Rows
from tests.engine.workflows import three, waiter

log = logging.getLogger(__name__)
ROOT = Path(__file__).parents[2]


async def in_chunks(n: int, make: Callable[[int], Awaitable[Any]], size: int = 200) -> list[Any]:
    out: list[Any] = []
    for first in range(0, n, size):
        out.extend(await asyncio.gather(*(make(i) for i in range(first, min(n, first + size)))))
    return out


@pytest.fixture
def worker_processes(database_url: str) -> Iterator[list[subprocess.Popen[str]]]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.engine.worker_proc", database_url, f"proc-{n}"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for n in (1, 2)
    ]
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
            for stream in (p.stdout, p.stderr):
                if stream is not None:
                    stream.close()


async def test_two_worker_processes_commit_every_step_once(
    engine: Engine, rows: Rows, worker_processes: list[subprocess.Popen[str]]
) -> None:
    for p in worker_processes:
        assert p.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(p.stdout.readline), 60)
        assert line == "ready\n", (line, p.stderr.read() if p.poll() is not None and p.stderr else "")

    ids = await in_chunks(200, lambda i: engine.client.start(three, {"order_id": f"mp-{i}"}))

    # Each wait wakes on its instance's settle notification (the client's one LISTEN connection).
    settled = await asyncio.gather(*(engine.client.wait_for(i, timeout=60) for i in ids))
    assert {s.status for s in settled} == {"COMPLETED"}

    for p in worker_processes:
        p.send_signal(signal.SIGTERM)
    outputs = [await asyncio.to_thread(p.communicate, timeout=30) for p in worker_processes]
    assert [p.returncode for p in worker_processes] == [0, 0], outputs
    stats = [json.loads(out.splitlines()[-1]) for out, _ in outputs]
    assert all(s["commits"] > 0 for s in stats), stats
    assert sum(s["commits"] for s in stats) - sum(s["fenced"] for s in stats) >= 3 * len(ids)

    per_visit = await rows.conn.fetch(
        "SELECT instance_id, visit, count(*) AS n FROM stepstone.history WHERE kind = 'STEP_COMPLETED' "
        "GROUP BY instance_id, visit"
    )
    assert len(per_visit) == 3 * len(ids) and {r["n"] for r in per_visit} == {1}
    per_instance = await rows.conn.fetch(
        "SELECT instance_id, count(*) AS n FROM stepstone.history WHERE kind = 'STEP_COMPLETED' GROUP BY instance_id"
    )
    assert {str(r["instance_id"]) for r in per_instance} == set(ids) and {r["n"] for r in per_instance} == {3}
    gaps = await rows.count(
        "SELECT count(*) FROM (SELECT instance_id, max(seq) = count(*) AS gapless FROM stepstone.history "
        "GROUP BY instance_id) h WHERE NOT gapless"
    )
    assert gaps == 0
    workers = await rows.conn.fetch("SELECT DISTINCT claimed_by FROM stepstone.commands WHERE claimed_by IS NOT NULL")
    assert {r["claimed_by"] for r in workers} == {"proc-1", "proc-2"}
    assert await rows.count("SELECT count(*) FROM stepstone.outbox") == len(ids)
    assert await rows.open_commands() == []


class CountingClaims:
    """Counts claim rounds (statements), to wait for the claim loop without sleeping."""

    def __init__(self, store: PostgresStore) -> None:
        self.rounds = 0
        self._claim = store.claim
        self._round = asyncio.Event()

        async def claim(*args: Any, **kwargs: Any) -> Any:
            out = await self._claim(*args, **kwargs)
            self.rounds += 1
            self._round.set()
            return out

        store.claim = claim  # type: ignore[method-assign]

    async def until(self, rounds: int, timeout: float) -> None:
        """Until `rounds` claim rounds have returned, woken by each one."""
        async with asyncio.timeout(timeout):
            while self.rounds < rounds:
                self._round.clear()
                await self._round.wait()


# Since the features of 2026-12-01 merged, 10,000 starts on the durable PostgreSQL 15 can outlast this
# test's 120 s waits (docs/performance-history.md, "the hot path got slower"): it runs in the embedded pass.
@pytest.mark.first_pass_only
async def test_ten_thousand_waiting_instances_hold_no_worker_slot(engine: Engine, rows: Rows) -> None:
    n = 10_000
    counting = CountingClaims(engine.store)
    worker = engine.new_worker(concurrency=4, lease_seconds=30, poll_interval=0.05, worker_id="idle-check")
    await worker.start()
    try:
        t0 = time.perf_counter()
        # One statement per batch: how they were started is not what this test is about.
        ids = await engine.client.start_many(waiter, [{"order_id": f"w-{i}"} for i in range(n)])
        t_start = time.perf_counter()

        await worker.events.wait_until(lambda: worker.events.commits >= n, timeout=120)
        t_waiting = time.perf_counter()
        assert await rows.count("SELECT count(*) FROM stepstone.instances WHERE status = 'WAITING'") == n
        assert await rows.count(
            "SELECT count(*) FROM stepstone.commands WHERE state IN ('PENDING', 'CLAIMED', 'DEFERRED')"
        ) == 0

        claims, rounds = worker.events.claims, counting.rounds
        await counting.until(rounds + 5, timeout=30)  # five more claim rounds
        assert worker.events.claims == claims == n
        assert worker.in_flight == 0

        await in_chunks(n, lambda i: engine.client.signal(ids[i], "go", {"i": i}))
        t_signal = time.perf_counter()
        # Two commits an instance: its START (into the wait), and the signal with the step it entered
        # (one commit: core.folding).
        await worker.events.wait_until(lambda: worker.events.commits >= 2 * n, timeout=180)
        t_done = time.perf_counter()
    finally:
        await worker.stop(drain_timeout=5)

    log.info(
        "10k waiting: start %.1f s, START commits %.1f s, signals sent %.1f s, signals applied %.1f s",
        t_start - t0, t_waiting - t_start, t_signal - t_waiting, t_done - t_signal,
    )
    assert await rows.count("SELECT count(*) FROM stepstone.instances WHERE status = 'COMPLETED'") == n
    assert await rows.count("SELECT count(*) FROM stepstone.history WHERE kind = 'SIGNAL_APPLIED'") == n
    assert worker.events.fenced == 0

