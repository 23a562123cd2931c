"""One worker process of the rig: ``python -m tests.chaos.worker_proc --url URL --lease 2 --concurrency 8``
(``--serve chains`` or ``--serve rest``: only some of the rig's workflows, see workflows.SERVED_PARTS).

Opens a PostgresStore, runs ``Worker.start()`` until SIGTERM, then stops (drain) and exits. Every 0.5 s and
at exit it writes its counters to ``--stats`` (JSON): claims, commits, fenced, released, commits whose
outcome was unknown (re-read), the positions whose commit was fenced, and the commits refused because the
shared state had moved on (state conflicts). A SIGKILLed process leaves its
last periodic file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from stepstone.core.model import Decision
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.port import Claim, Committed
from stepstone.store.postgres import PostgresStore
from tests.chaos import family, workflows


class _Counting(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.unknown = 0
        self.warnings = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.warnings += 1
        if "interrupted" in record.getMessage():
            self.unknown += 1


class RigWorker(Worker):
    """The engine's worker, noting which commits were fenced (test code only; no production switch)."""

    fenced_log: list[dict[str, Any]]
    conflict_log: list[dict[str, Any]]

    async def _segment(self, claim: Claim) -> None:
        # A worker slow to apply a child's COMPLETED report (a pause between its claim and its commit, its lease
        # renewed meanwhile), for a parent whose state asks for it (family.py's `hold_report`): held until the
        # parent's saga begins, at most that many seconds; the window in which a cancel or a deadline begins the
        # parent's saga while the report is claimed and not applied.
        state, payload = claim.instance.state, claim.command.payload
        if claim.command.kind == "CHILD_COMPLETION" and isinstance(state, dict) and state.get(family.HOLD_REPORT) \
                and isinstance(payload, dict) and payload.get("status") == "COMPLETED":
            await _hold(claim.instance.id, float(state[family.HOLD_REPORT]))
        await super()._segment(claim)

    async def _commit(
        self, claim: Claim, command_id: int, decision: Decision, visit: int, state_version: int
    ) -> Committed | None:
        result = await super()._commit(claim, command_id, decision, visit, state_version)
        where = {"instance": claim.instance.id, "position": claim.instance.position, "visit": visit,
                 "command": command_id}
        if result is None:
            self.fenced_log.append(where)
            print(f"FENCED {where}", flush=True)  # noqa: T201
        elif result.conflict:
            self.conflict_log.append(where)  # the shared state moved on; the worker rebases or runs again
        return result


async def _hold(instance_id: str, seconds: float) -> None:
    """Until the instance is no longer RUNNING or WAITING (its saga began, or it ended), at most `seconds`."""
    loop = asyncio.get_running_loop()
    until = loop.time() + seconds
    pool = await workflows.LEDGER.get()
    while loop.time() < until:
        status = await pool.fetchval("SELECT status FROM stepstone.instances WHERE id = $1", uuid.UUID(instance_id))
        if status not in ("RUNNING", "WAITING"):
            return
        await asyncio.sleep(0.05)  # the simulated slowness, polling the saga's start


async def main(args: argparse.Namespace) -> None:
    worker_id = f"{args.name}:{os.getpid()}"
    workflows.configure(args.url, worker_id)
    counting = _Counting()
    logging.getLogger("stepstone").addHandler(counting)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s {worker_id} %(levelname)s %(name)s %(message)s")
    store = await _open(args.url, args.concurrency)
    config = WorkerConfig(concurrency=args.concurrency, lease_seconds=args.lease, poll_interval=args.poll,
                          worker_id=worker_id, drain_timeout=args.drain,
                          max_claims=int(os.environ.get(workflows.MAX_CLAIMS_ENV) or WorkerConfig.max_claims))
    worker = RigWorker(store, workflows.served(args.serve), config)
    worker.fenced_log = []
    worker.conflict_log = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    stats = Path(args.stats) if args.stats else None

    def dump(final: bool) -> None:
        if stats is None:
            return
        ev = worker.events
        doc = {"pid": os.getpid(), "worker": worker_id, "final": final, "claims": ev.claims, "commits": ev.commits,
               "fenced": ev.fenced, "released": ev.released, "crashed": getattr(ev, "crashed", 0),
               "unknown_outcome": counting.unknown,
               "warnings": counting.warnings, "fenced_log": worker.fenced_log,
               "conflicts": len(worker.conflict_log), "conflict_log": worker.conflict_log[-200:]}
        tmp = stats.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(stats)

    await _retrying(worker.start)
    print(f"READY {worker_id}", flush=True)  # noqa: T201
    while not stop.is_set():
        dump(final=False)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    await worker.stop()
    dump(final=True)
    await store.close()


async def _open(url: str, concurrency: int) -> PostgresStore:
    async def attempt() -> PostgresStore:
        return await PostgresStore.open(url, max_size=concurrency + 4)

    return await _retrying(attempt)


async def _retrying(fn: Any) -> Any:
    """Start-up against a server that may be restarting: retry for up to a minute."""
    delay = 0.1
    last: Exception = RuntimeError("not attempted")
    for _ in range(60):
        try:
            return await fn()
        except Exception as exc:  # noqa: BLE001 - any start-up failure is retried, then raised
            last = exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
    raise last


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.chaos.worker_proc")
    p.add_argument("--url", required=True)
    p.add_argument("--lease", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--poll", type=float, default=1.0)
    p.add_argument("--drain", type=float, default=5.0)
    p.add_argument("--name", default="w")
    p.add_argument("--stats", default="")
    p.add_argument("--serve", choices=workflows.SERVED_PARTS, default="all", help="the workflows it serves")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
