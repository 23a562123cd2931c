"""A worker process for the benchmarks: `python -m stepstone.bench.worker_proc [options]`.

The database URL comes from the environment (`STEPSTONE_BENCH_DATABASE_URL`), never the command line.

Runs a `Worker` on the bench workflows until SIGTERM (drains, then exits) or SIGKILL. Reports JSON
lines on stdout: `ready`, `holding` (with --hold, once --hold-target handlers wait on their event),
`exit`; each carries `maxrss_kb`, the process's peak resident set so far.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import sys
from pathlib import Path

from stepstone.bench.procs import URL_ENV
from stepstone.bench.workflows import HOLD, registry
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.factory import open_store


def peak_rss_kb() -> int:
    """This process's peak resident set, in KiB.

    Linux keeps `ru_maxrss` across exec: a process started from a large one (the bench, after seeding
    a million instances) reported that process's peak as its own, 102 MB for a worker that peaked at
    about 41. `VmHWM` is the peak of this program's own memory. Elsewhere, `ru_maxrss` (an upper bound).
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak  # bytes on macOS, KiB on Linux


def report(event: str, **data: object) -> None:
    sys.stdout.write(json.dumps({"event": event, "maxrss_kb": peak_rss_kb(), **data}) + "\n")
    sys.stdout.flush()


async def main(args: argparse.Namespace) -> None:
    HOLD.enabled = args.hold
    HOLD.target = args.hold_target
    store = await open_store(args.url, args.schema, max_size=args.pool)
    worker = Worker(store, registry, WorkerConfig(
        concurrency=args.concurrency, lease_seconds=args.lease, worker_id=args.worker_id,
    ))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await worker.start()
    report("ready")

    async def holding() -> None:
        await HOLD.reached.wait()
        report("holding", in_flight=worker.in_flight, entered=HOLD.entered)

    watcher = asyncio.create_task(holding()) if args.hold else None
    await stop.wait()
    HOLD.release.set()
    if watcher is not None:
        watcher.cancel()
    await worker.stop()
    await store.close()
    report("exit", commits=worker.events.commits, conflicts=worker.events.conflicts)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepstone.bench.worker_proc")
    parser.add_argument("--schema", default="stepstone")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--pool", type=int, default=12)
    parser.add_argument("--lease", type=float, default=30.0)
    parser.add_argument("--worker-id", default="bench-worker")
    parser.add_argument("--hold", action="store_true", help="bench_hold handlers wait until SIGTERM")
    parser.add_argument("--hold-target", type=int, default=1)
    args = parser.parse_args(argv)
    args.url = os.environ.get(URL_ENV)
    if not args.url:
        parser.error(f"set {URL_ENV} to the database URL")
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
