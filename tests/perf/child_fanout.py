"""Children/s of a parent that starts N children at once, of whichever stepstone is importable.

Not a test (pytest does not collect it): a harness for interleaved A/B runs of two trees, as
ab_throughput.py is (`PYTHONPATH=<other tree>/src python tests/perf/child_fanout.py before`, then the same
without PYTHONPATH, alternately). A fresh database on the server at --admin-url, an in-process worker of 8
slots; a parent maps over --children items, each branch a child step whose child runs one step; the join,
then the parent ends. One parent of warm-up, ANALYZE, then --parents measured one after the other: children
a second from the first start to the last parent's end, the store calls of the measured run counted (the
version selections of the child steps, claims, commits) with the median round trip of each, and this
process's CPU time a child.

    python tests/perf/child_fanout.py after --children 200 --parents 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

import asyncpg
from pydantic import BaseModel, Field
from scratch_database import scratch_database  # a sibling: see scratch_database.py

from stepstone import Registry, StepContext, Workflow
from stepstone.client import Client
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.migrate import migrate
from stepstone.store.postgres import PostgresStore
from stepstone.store.registry import PostgresRegistry

SCHEMA = "stepstone"
SLOTS = 8


class Kid(BaseModel):
    n: int = 0


class Parent(BaseModel):
    items: list[int] = Field(default_factory=list)
    done: int = 0


kid: Workflow[Kid] = Workflow("ab_kid", version=1, state=Kid)


@kid.step(next=None, start=True)
async def grow(_ctx: StepContext, state: Kid) -> None:
    state.n += 1


parent: Workflow[Parent] = Workflow("ab_parent", version=1, state=Parent)
parent.fork("spread", map_over="items", branch="spawn", start=True)


@parent.child(workflow="ab_kid", next="gather")
async def spawn(ctx: StepContext, _state: Parent) -> dict[str, Any]:
    assert ctx.branch is not None
    return {"n": int(ctx.branch.item)}


parent.join("gather", fork="spread", next="tally")


@parent.step(next=None)
async def tally(_ctx: StepContext, state: Parent) -> None:
    state.done = len(state.items)


registry = Registry(kid, parent)


class Calls:
    """Records the round trip of each call of the wrapped store methods (those of the measured run)."""

    def __init__(self) -> None:
        self.on = False
        self.trips: dict[str, list[float]] = {}

    def wrap(self, owner: type, name: str) -> None:
        method = getattr(owner, name)

        async def timed(this: Any, *args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            result = await method(this, *args, **kwargs)
            if self.on:
                self.trips.setdefault(name, []).append(time.perf_counter() - began)
            return result

        setattr(owner, name, timed)


async def run_parent(client: Client, children: int, ended: Callable[[str], Any]) -> None:
    iid = await client.start(parent, {"items": list(range(children))})
    await ended(iid)


async def measure(url: str, children: int, parents: int) -> tuple[float, float, Calls]:
    """(children/s, this process's CPU µs a child, the store calls) of the measured run."""
    calls = Calls()
    calls.wrap(PostgresRegistry, "select_version")
    for name in ("claim", "commit", "commit_many"):
        calls.wrap(PostgresStore, name)
    conn = await asyncpg.connect(url)
    try:
        await migrate(conn, SCHEMA)
    finally:
        await conn.close()
    store = await PostgresStore.open(url, SCHEMA, max_size=SLOTS + 4)
    client = Client(store, registry)
    worker = Worker(store, registry, WorkerConfig(concurrency=SLOTS, worker_id="ab"))
    await worker.start()

    async def ended(iid: str) -> None:
        info = await client.wait_for(iid, timeout=600)
        assert info.status == "COMPLETED", info.status

    try:
        await run_parent(client, children, ended)
        await store.pool.execute("ANALYZE")
        calls.on = True
        cpu = time.process_time()
        began = time.perf_counter()
        for _ in range(parents):
            await run_parent(client, children, ended)
        seconds = time.perf_counter() - began
        cpu = time.process_time() - cpu
        calls.on = False
        return children * parents / seconds, cpu / (children * parents) * 1e6, calls
    finally:
        await worker.stop()
        await store.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("label", help="printed before the result")
    parser.add_argument("--children", type=int, default=200, help="children of each parent")
    parser.add_argument("--parents", type=int, default=5, help="parents measured, one after the other")
    parser.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    async with scratch_database(args.admin_url, "stepstone_ab_children") as url:
        rate, cpu, calls = await measure(url, args.children, args.parents)
    print(f"{args.label} {rate:.0f} children/s")  # noqa: T201
    print(f"  CPU {cpu:.0f} us a child")  # noqa: T201
    for name, trips in sorted(calls.trips.items()):
        print(f"  {name:14} {len(trips):6,} calls, round trip p50 {statistics.median(trips) * 1e6:.0f} us")  # noqa: T201


if __name__ == "__main__":
    asyncio.run(main())
