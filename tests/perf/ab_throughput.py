"""Three-step workflows/s of whichever stepstone is importable, for interleaved A/B runs of two trees.

Not a test (pytest does not collect it): the harness behind the A/B tables of docs/performance-history.md.
It runs the `throughput` workload's shape on its own, with nothing that differs between versions:
a fresh database on the server at --admin-url, an in-process worker of 8 slots, 8 starters in a closed
loop (at most 32 unfinished), 300 workflows of warm-up, ANALYZE (the steady state), then --total
measured. Completions are counted by a trigger this harness adds to `instances` (notifying with the
instance id: PostgreSQL folds identical notifications of one transaction into one), so both sides are
counted alike even when one has no completion channel of its own.

With --waiting the workflows are `bench_waiting`'s instead: one step, then a timer of 30 days, and a
workflow counts when its instance reaches WAITING (what entering a timed wait costs: "The timer in place"
in docs/performance-history.md). Either way it also prints the WAL the measured run wrote, per workflow, and
this process's CPU time (the starters and the worker, as the bench's "engine CPU") per step commit.

    python tests/perf/ab_pairs.py --before <commit> --pairs 4

(runs this harness on a worktree of <commit>, its `src` first on PYTHONPATH, and on the working tree,
alternately).

With --timings it also prints, for each store call of the measured run (claims, commits, group
commits, starts), how many there were, their items (the segments of a group commit), their round
trips, and the share of the run some call of that kind was in flight ("The group committer's rhythm"
in docs/performance-history.md).

With --idle N, N more workers run beside it, each serving only `bench_signal`, of which nothing is
started: a pool of another workflow with nothing to do. It prints how many claims they made during the
measured run ("Wake-ups for the served workflows" in docs/performance-history.md).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from typing import Any

import asyncpg
from scratch_database import scratch_database  # a sibling: see scratch_database.py

from stepstone.authoring.workflow import Registry
from stepstone.bench.workflows import registry, signal_wf, three, waiting
from stepstone.client import Client
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.migrate import migrate
from stepstone.store.postgres import PostgresStore

SCHEMA = "stepstone"
STARTERS = SLOTS = 8
TRIGGER = """
CREATE FUNCTION public.ab_completed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = '{status}' AND OLD.status IS DISTINCT FROM NEW.status THEN
        PERFORM pg_notify('ab_completed', NEW.id::text);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER ab_completed AFTER UPDATE OF status ON {schema}.instances
    FOR EACH ROW EXECUTE FUNCTION public.ab_completed();
"""


class Timings:
    """Wraps PostgresStore's statement methods to record when each call of the measured run went out."""

    METHODS = ("claim", "commit", "commit_many", "start", "start_many")

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[float, float, int]]] = {name: [] for name in self.METHODS}
        for name in self.METHODS:
            setattr(PostgresStore, name, self._timed(name, getattr(PostgresStore, name)))

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        async def timed(store: PostgresStore, *args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            result = await method(store, *args, **kwargs)
            items = len(args[0]) if name == "commit_many" else 1  # a start_many's batch is not counted
            self.calls[name].append((began, time.perf_counter(), items))
            return result
        return timed

    def report(self, since: float, until: float) -> None:
        for name, every in self.calls.items():
            calls = sorted(c for c in every if c[0] >= since)
            if not calls:
                continue
            busy, reached = 0.0, since
            for began, ended, _ in calls:  # the union of the calls' intervals
                busy += max(0.0, ended - max(began, reached))
                reached = max(reached, ended)
            trips = sorted(ended - began for began, ended, _ in calls)
            print(f"  {name:12} {len(calls):6,} calls {sum(c[2] for c in calls):7,} items"  # noqa: T201
                  f"  round trip p50 {trips[len(trips) // 2] * 1e3:.2f} ms"
                  f"  in flight {busy / (until - since):.0%} of the run")


def _counted(claim: Callable[..., Any], count: list[int]) -> Callable[..., Any]:
    async def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return await claim(*args, **kwargs)
    return counted


async def measure(
    url: str, total: int, timings: Timings | None = None, *, wait: bool = False, idle: int = 0
) -> tuple[float, float, float]:
    """(workflows/s, WAL bytes a workflow, this process's CPU seconds a step commit) of the measured run."""
    conn = await asyncpg.connect(url)
    await migrate(conn, SCHEMA)
    await conn.execute(TRIGGER.format(status="WAITING" if wait else "COMPLETED", schema=SCHEMA))
    workflow = waiting if wait else three
    completed = [0]
    changed = asyncio.Event()

    def on_completed(*_: object) -> None:
        completed[0] += 1
        changed.set()

    await conn.add_listener("ab_completed", on_completed)
    worker_store = await PostgresStore.open(url, SCHEMA, max_size=SLOTS + 4)
    client_store = await PostgresStore.open(url, SCHEMA, max_size=STARTERS + 2)
    client = Client(client_store, registry)
    worker = Worker(worker_store, registry, WorkerConfig(concurrency=SLOTS, worker_id="ab"))
    await worker.start()
    idle_stores = [await PostgresStore.open(url, SCHEMA, max_size=3) for _ in range(idle)]
    idle_workers = [Worker(s, Registry(signal_wf), WorkerConfig(concurrency=2, worker_id=f"idle{n}"))
                    for n, s in enumerate(idle_stores)]
    idle_statements = [0]
    for idle_store in idle_stores:
        idle_store.claim = _counted(idle_store.claim, idle_statements)  # type: ignore[method-assign]
    for w in idle_workers:
        await w.start()

    async def until(condition: Callable[[], bool]) -> None:
        while not condition():
            changed.clear()
            await changed.wait()

    async def closed_loop(count: int) -> float:
        base, started = completed[0], [0]
        began = time.monotonic()

        def room() -> bool:
            return started[0] - (completed[0] - base) < 4 * SLOTS

        async def starter() -> None:
            while True:
                await until(room)
                if started[0] >= count:
                    return
                started[0] += 1
                await client.start(workflow, {})

        await asyncio.gather(*(starter() for _ in range(STARTERS)))
        await until(lambda: completed[0] - base >= count)
        return count / (time.monotonic() - began)

    try:
        await closed_loop(300)
        await conn.execute("ANALYZE")
        began = time.perf_counter()
        wal = await conn.fetchval("SELECT pg_current_wal_lsn()")
        cpu = time.process_time()
        idle_claims = idle_statements[0]
        run_began = time.monotonic()
        rate = await closed_loop(total)
        cpu = time.process_time() - cpu
        if idle_workers:
            claims = idle_statements[0] - idle_claims
            print(f"  {idle} idle workers (another workflow's pool): {claims:,} claim statements"  # noqa: T201
                  f" ({claims / (time.monotonic() - run_began):,.0f}/s)")
        if timings is not None:
            timings.report(began, time.perf_counter())
        wal_bytes = await conn.fetchval("SELECT pg_current_wal_lsn() - $1::pg_lsn", wal)
        return rate, float(wal_bytes) / total, cpu / (total * (1 if wait else 3))
    finally:
        for w in idle_workers:
            await w.stop()
        for s in idle_stores:
            await s.close()
        await worker.stop()
        await worker_store.close()
        await client_store.close()
        await conn.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("label", help="printed before the result")
    parser.add_argument("--total", type=int, default=3000, help="workflows measured after the warm-up")
    parser.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--timings", action="store_true", help="time the store's calls (see the docstring)")
    parser.add_argument("--waiting", action="store_true", help="workflows that enter a timed wait (see above)")
    parser.add_argument("--idle", type=int, default=0,
                        help="workers of another workflow (bench_signal) beside it, with nothing to do (see above)")
    args = parser.parse_args()
    async with scratch_database(args.admin_url, "stepstone_ab") as url:
        rate, wal, cpu = await measure(url, args.total, Timings() if args.timings else None, wait=args.waiting,
                                       idle=args.idle)
    print(f"  WAL {wal:,.0f} bytes a workflow", flush=True)  # noqa: T201
    print(f"  CPU {cpu * 1e6:.0f} us a step commit (this process: starts, worker, commits)", flush=True)  # noqa: T201
    print(f"{args.label} {rate:.0f} workflows/s", flush=True)  # noqa: T201 - the result is the output


if __name__ == "__main__":
    asyncio.run(main())
