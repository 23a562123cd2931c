"""The execution probe: `idle` from a read that cannot miss busy work, however many commands wait."""

from __future__ import annotations

import asyncpg

from stepstone.bench.common import seed_waiting
from stepstone.bench.workflows import waiting
from stepstone.core.pin import pin_of
from stepstone.ops import Operations
from stepstone.ops.queries import MAX_REPORT
from stepstone.store.operations_port import InstanceFilter
from stepstone.testing import Engine
from tests.ops import workflows
from tests.ops.test_cli_operations import run


async def test_busy_work_shows_behind_more_waiting_timers_than_the_report_lists(
        engine: Engine, ops: Operations, database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:  # older instances than any the client starts, each waiting on its timer: a full report of them
        await seed_waiting(conn, "stepstone", pin_of(waiting), 1, MAX_REPORT + 1)
    finally:
        await conn.close()
    held = await engine.client.start(workflows.flaky, {}, business_key="held")
    [claim] = await engine.store.claim(1, 60, "probe-test")  # in flight: claimed under a live lease
    assert claim.business_key == "held"
    fresh = await engine.client.start(workflows.flaky, {}, business_key="fresh")  # claimable, not run

    report = await ops.probe()
    assert not report.idle
    assert [c["instance_id"] for c in report.in_flight] == [held]
    assert [c["instance_id"] for c in report.claimable] == [fresh]
    assert len(report.waiting) == MAX_REPORT and report.more  # the listing of the rest stays capped, and says so
    mine = await ops.probe(where=InstanceFilter(workflow="ops_flaky"))
    assert not mine.idle and [c["instance_id"] for c in mine.claimable] == [fresh] and mine.waiting == []
    assert not mine.more
    one = await ops.probe(fresh)
    assert not one.idle and one.in_flight == [] and [c["instance_id"] for c in one.claimable] == [fresh]
    assert (await ops.probe(where=InstanceFilter(workflow=pin_of(waiting).definition_id))).idle
    everything = await run(database_url, "probe")
    assert everything.exit_code == 3 and "(more are open: the first of each are listed" in everything.stdout
    assert (await run(database_url, "probe", "--business-key", "fresh")).exit_code == 3
