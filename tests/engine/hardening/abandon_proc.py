"""An application embedding a worker whose synchronous handler never returns.

    python -m tests.engine.hardening.abandon_proc DATABASE_URL

Runs the worker until a `stuck` handler is inside its step, stops it with a short drain,
prints what `stop()` returned and returns from main: the process must then exit on its own.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.postgres import PostgresStore
from tests.engine.hardening.workflows import registry


class _Entered(logging.Handler):
    def __init__(self, loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
        super().__init__()
        self.loop, self.event = loop, event

    def emit(self, record: logging.LogRecord) -> None:
        if "stuck handler entered" in record.getMessage():
            self.loop.call_soon_threadsafe(self.event.set)


async def main(url: str) -> None:
    entered = asyncio.Event()
    logging.getLogger("stepstone.tests").addHandler(_Entered(asyncio.get_running_loop(), entered))
    store = await PostgresStore.open(url, max_size=4)
    try:
        worker = Worker(store, registry, WorkerConfig(concurrency=2, poll_interval=0.05))
        await worker.start()
        await asyncio.wait_for(entered.wait(), 30)
        abandoned = await worker.stop(drain_timeout=0.1)
        sys.stdout.write(f"stop returned {abandoned}; abandoned_threads {worker.abandoned_threads}\n")
        sys.stdout.flush()
    finally:
        await store.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
