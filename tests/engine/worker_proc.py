"""A worker in its own process, for the multi-process tests.

    python -m tests.engine.worker_proc DATABASE_URL WORKER_ID

Prints "ready" once claiming, runs until SIGTERM, drains, then prints its counters as JSON.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.postgres import PostgresStore
from tests.engine.workflows import registry


async def main(url: str, worker_id: str) -> None:
    store = await PostgresStore.open(url, max_size=6)
    try:
        worker = Worker(store, registry, WorkerConfig(concurrency=4, lease_seconds=30, poll_interval=0.2,
                                                      worker_id=worker_id))
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await worker.start()
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        await stop.wait()
        await worker.stop(drain_timeout=5)
        e = worker.events
        sys.stdout.write(json.dumps({"claims": e.claims, "commits": e.commits, "fenced": e.fenced}) + "\n")
        sys.stdout.flush()
    finally:
        await store.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
