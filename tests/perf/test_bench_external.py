"""The external-task workload of `stepstone bench` runs end to end at a tiny size (numbers are not checked)."""

from __future__ import annotations

from stepstone.bench import runner
from stepstone.bench.common import BenchContext, Sizes
from stepstone.bench.external_tasks import measure
from tests._pg import PgServer


async def test_external_workload_is_registered_and_answers_every_task(pg_server: PgServer) -> None:
    assert "external" in runner.WORKLOADS
    ctx = BenchContext(admin_url=pg_server.admin_url, schema="stepstone", sizes=Sizes.quick(), concurrency=2,
                       processes=0, bin_dir="")
    metrics = {m.name: m for m in await measure(ctx, 20, workers=2)}  # asserts every task was answered once
    assert (metrics["fetch and complete"].value or 0) > 0
    assert (metrics["completions run by the engine"].value or 0) > 0
