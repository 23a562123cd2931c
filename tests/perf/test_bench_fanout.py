"""The fan-out workload of `stepstone bench` runs end to end at a tiny size (numbers are not checked).

What is checked is structure: the workload is registered, every map item ran exactly once, the
shares of the worker processes add up to all items, and only those processes ran branch steps.
"""

from __future__ import annotations

from dataclasses import replace

from stepstone.bench import runner
from stepstone.bench.common import BenchContext, Sizes
from stepstone.bench.fanout import map_spread
from tests._pg import PgServer

TINY = replace(Sizes.quick(), fanout_branches=3, fanout_seconds=0.05, fanout_repeats=1, map_items=20)


def _ctx(admin_url: str) -> BenchContext:
    return BenchContext(admin_url=admin_url, schema="stepstone", sizes=TINY, concurrency=2, processes=2, bin_dir="")


async def test_map_runs_every_item_once_spread_over_the_processes(database_url: str) -> None:
    result = await map_spread(_ctx(database_url), database_url, 20, processes=2)
    assert result.commits == 20
    assert sum(result.shares.values()) == 20
    assert set(result.shares) <= {"bench-proc-0", "bench-proc-1"}
    assert result.seconds > 0


async def test_fanout_workload_is_registered_and_reports_its_lines(pg_server: PgServer) -> None:
    assert "fanout" in runner.WORKLOADS
    metrics = {m.name: m for m in await runner.WORKLOADS["fanout"](_ctx(pg_server.admin_url))}
    wall = metrics["wall time (3 branches x 0.05 s, 3 slots)"]
    assert wall.value is not None and wall.value > 0
    assert "wall / serial time (3 branches x 0.05 s, 3 slots)" in metrics
    assert "map items/s (20 items, 2 worker processes)" in metrics
    shares = [m.value or 0.0 for name, m in metrics.items() if name.startswith("map share of branch steps")]
    assert abs(sum(shares) - 100.0) < 1e-6
