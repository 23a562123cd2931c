"""The engine's Python a step, without a database: what the worker and the client spend per step and per
start when no statement runs.

Not a test (pytest does not collect it): a diagnostic behind docs/performance-history.md ("Less Python a step").
`ab_throughput.py` measures the whole process on a real server, where a run's CPU a step commit moves by
a few percent between runs; this takes the server out, so a change of one µs in the step's Python shows
(three runs of one tree agree within about 1%). It runs the worker's segment loop (`Worker._segment`:
decide, run the handler, commit, go on to the next step) over `bench_three` claims made in memory, 8 at a
time, against a store that builds each commit's document and encodes it as the real store does and
answers with a continuation; and `Client.start` against a store that returns at once.

    python tests/perf/step_python.py --workflows 16000

It follows the worker's internal names (`_segment`) and the store's (`_document`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import uuid
from datetime import UTC, datetime
from typing import Any

from stepstone.bench.workflows import registry, three
from stepstone.client import Client
from stepstone.core import json_text
from stepstone.core.model import CommandView, InstanceView
from stepstone.core.pin import pin_of
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.port import Claim, CommitRequest, Committed
from stepstone.store.postgres import _document

SLOTS = 8
NOW = datetime.now(UTC)


class CommittingStore:
    """Commits in memory: each request's document built and encoded, a continuation id handed back."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)

    async def commit_many(self, requests: list[CommitRequest], *, lease_seconds: float,
                          worker: str) -> list[Committed | None]:
        json_text.dumps([_document(r, lease_seconds, worker) for r in requests])
        await asyncio.sleep(0)  # the round trip: other segments run meanwhile, and queue behind it
        return [Committed(next(self._ids) if r.decision.continuation is not None else None, NOW,
                          r.state_version + 1) for r in requests]

    async def commit(self, request: CommitRequest, *, lease_seconds: float, worker: str) -> Committed | None:
        return (await self.commit_many([request], lease_seconds=lease_seconds, worker=worker))[0]


class StartingStore:
    """Starts in memory: the version is registered, the start returns its new id."""

    class _Definitions:
        async def select_version(self, *_: Any) -> None:
            return None

    definitions = _Definitions()

    async def register(self, *_: Any, **__: Any) -> None:
        return None

    async def start(self, new: Any) -> tuple[str, bool]:
        return new.id, True


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


async def steps(workflows: int) -> float:
    """CPU µs a step of `workflows` three-step workflows, each a segment from its START claim to its end."""
    worker = Worker(CommittingStore(), registry, WorkerConfig(concurrency=SLOTS))  # type: ignore[arg-type]
    pin, commands = pin_of(three), itertools.count(1)
    state = {"n": 0, "payload": "x" * 80}

    async def run(count: int) -> None:
        for _ in range(count):
            instance = InstanceView(str(uuid.uuid4()), "PENDING", three.plan.start, 0, dict(state))
            await worker._segment(Claim(instance, CommandView(next(commands), "START"), pin, uuid.uuid4(), NOW))

    await asyncio.gather(*(run(50) for _ in range(SLOTS)))  # warm-up
    began = _cpu()
    await asyncio.gather(*(run(workflows // SLOTS) for _ in range(SLOTS)))
    return (_cpu() - began) * 1e6 / (workflows // SLOTS * SLOTS * 3)


async def starts(count: int) -> float:
    """CPU µs of the client's side of one `Client.start`."""
    client = Client(StartingStore(), registry)  # type: ignore[arg-type]
    for _ in range(1000):
        await client.start(three, {})
    began = _cpu()
    for _ in range(count):
        await client.start(three, {})
    return (_cpu() - began) * 1e6 / count


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workflows", type=int, default=16000, help="three-step workflows run (and starts made)")
    args = parser.parse_args()
    step = await steps(args.workflows)
    print(f"{step:.1f} µs of CPU a step (the worker's segment loop and commit document)")  # noqa: T201
    print(f"{await starts(args.workflows):.1f} µs of CPU a start (the client's side)")  # noqa: T201


if __name__ == "__main__":
    asyncio.run(main())
