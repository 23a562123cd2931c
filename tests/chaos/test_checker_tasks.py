"""The checker's task and message rules can fail: a clean run of human-task instances (each task
completed, each instance's message published twice with one id) is checked clean, then each fabricated
violation, applied in a transaction that is rolled back, must be reported under its own name."""

from __future__ import annotations

import random

import asyncpg

from stepstone.testing import open_engine
from tests._pg import PgServer
from tests.chaos import workflows
from tests.chaos.rig import checker
from tests.chaos.rig.scenarios import Target, scenario_database, start_instances
from tests.chaos.test_checker_branches import COPY_HISTORY

N = 6  # top-level workflows, half of them human tasks

FIRST_TASK = "(SELECT id FROM stepstone.tasks ORDER BY id LIMIT 1)"
FIRST_MESSAGE = "(SELECT min(id) FROM stepstone.messages)"
A_TASK_INSTANCE = "(SELECT min(instance_id::text)::uuid FROM stepstone.tasks)"
DOUBLE_DELIVERY = f"UPDATE stepstone.messages SET deliveries = deliveries || deliveries WHERE id = {FIRST_MESSAGE}"
WRONG_MESSAGE = f"UPDATE stepstone.instances SET state = state || '{{\"got\": \"x\"}}' WHERE id = {A_TASK_INSTANCE}"
MUTATIONS = {
    "completed twice": ("task_once", COPY_HISTORY, ("TASK_COMPLETED", False)),
    "left open": ("task_once", f"UPDATE stepstone.tasks SET status = 'OPEN' WHERE id = {FIRST_TASK}", ()),
    "correlated twice": ("message_once", COPY_HISTORY, ("MESSAGE_CORRELATED", False)),
    "delivered twice": ("message_once", DOUBLE_DELIVERY, ()),
    "another key's message": ("message_once", WRONG_MESSAGE, ()),
}


async def test_checker_reports_each_fabricated_task_and_message_violation(pg_server: PgServer) -> None:
    async with scenario_database(Target(pg_server.admin_url), "checkertasks") as url:
        await start_instances(url, N, random.Random(5), tasks=0.5)  # noqa: S311 - a test mix
        workflows.configure(url, "checker-test")
        try:
            async with open_engine(url, workflows.registry, concurrency=4) as engine:
                await engine.advance(seconds=1)  # runs everything, the chains' naps too
                for task in (await engine.client.tasks(mode="all")).tasks:
                    await engine.client.complete_task(task.id, "approve", None, actor="rig", admin=True)
                await engine.run_until_idle()
                conn = await asyncpg.connect(url)
                try:
                    keys = [r[0] for r in await conn.fetch("SELECT state->>'key' FROM stepstone.instances "
                                                           "WHERE definition_id = $1", workflows.TASK.id)]
                finally:
                    await conn.close()
                for key in keys * 2:  # the repeat, with the same message id, changes nothing
                    await engine.client.publish_message(workflows.RECEIPT, key, {"key": key}, message_id=key, ttl=60)
                await engine.run_until_idle()
        finally:
            if workflows.LEDGER.pool is not None:
                await workflows.LEDGER.pool.close()
            workflows.LEDGER.pool, workflows.LEDGER.lock = None, None
        conn = await asyncpg.connect(url)
        try:
            report = await checker.check(conn, expected=N)
            assert report["violations"] == [], report
            assert report["task_instances"] == len(keys) == report["task_completions"] == \
                report["messages_correlated"] == 3
            for name, (kind, sql, args) in MUTATIONS.items():
                tr = conn.transaction()
                await tr.start()
                try:
                    status = await conn.execute(sql, *args)
                    assert status.split()[-1] != "0", f"{name}: the mutation changed nothing"
                    found = {v.split(":", 1)[0] for v in (await checker.check(conn, expected=N))["violations"]}
                finally:
                    await tr.rollback()
                assert kind in found, f"{name}: the checker reported only {found}"
        finally:
            await conn.close()
