"""One external-task worker process of the rig: ``python -m tests.chaos.external_proc --url URL --lease 1``
(the arguments of worker_proc, so that a `Fleet` runs these too: `--lease` is the lock duration,
`--concurrency` the tasks fetched at once; `--poll`, `--serve` and `--drain` are taken and unused).

An `ExternalWorker` on the topic of `chaosext-1`: its handler records its effect in the ledger (key
``<task id>/charge``, one row per invocation, on its own connection), lingers for the handler pause, and
completes the task with ``charge = "ch-<task id>"``. Every 0.5 s and at exit it writes its counters to
``--stats``: the answers sent and dropped (a lock refused while its handler ran). A SIGKILLed process
leaves locks behind, which expire and are fetched again by another worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any

from stepstone.external import ExternalTasks, ExternalWorker, LockedTask
from tests.chaos import workflows
from tests.chaos.worker_proc import parse


async def record(task: LockedTask) -> None:
    """The handler's effect: one ledger row per invocation, retried until it is there."""
    pool = await workflows.LEDGER.get()
    await pool.execute(
        "INSERT INTO chaos.ledger (effect_id, key, instance_id, step, attempt, pid, worker) "
        "VALUES (gen_random_uuid(), $1, $2, $3, $4, $5, $6)",
        f"{task.id}/{task.step}", uuid.UUID(task.instance_id), task.step, task.attempts + 1, os.getpid(),
        workflows.LEDGER.worker)


async def main(url: str, name: str, lock: float, max_tasks: int, stats: Path | None) -> None:
    worker_id = f"{name}:{os.getpid()}"
    workflows.configure(url, worker_id)
    pause = float(os.environ.get(workflows.PAUSE_ENV, "0") or 0)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    async with await ExternalTasks.open(url) as tasks:
        worker = ExternalWorker(tasks, worker_id, lock_duration=lock, max_tasks=max_tasks, long_poll=1.0)

        @worker.subscribe(workflows.EXT_TOPIC)
        async def charge(task: LockedTask) -> dict[str, Any]:
            await record(task)
            if pause > 0:
                await asyncio.sleep(pause)  # the work after the effect: the window a kill hits, lock held
            return {"charge": f"ch-{task.id}"}

        def dump(final: bool) -> None:
            if stats is not None:
                doc = {"pid": os.getpid(), "worker": worker_id, "final": final, "answered": worker.answered,
                       "dropped": worker.dropped, "claims": 0, "commits": 0, "fenced": 0, "fenced_log": []}
                stats.with_suffix(".tmp").write_text(json.dumps(doc))
                stats.with_suffix(".tmp").replace(stats)

        async def dumping() -> None:
            while not stop.is_set():
                dump(final=False)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)

        print(f"READY {worker_id}", flush=True)  # noqa: T201
        await asyncio.gather(worker.run(stop), dumping())
        dump(final=True)


if __name__ == "__main__":
    args = parse()
    asyncio.run(main(args.url, args.name, args.lease, args.concurrency, Path(args.stats) if args.stats else None))
