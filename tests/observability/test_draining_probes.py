"""The probes of a worker that drains after a stop signal: alive (it is finishing its steps, as the grace
period gives it time to), and not ready (it claims nothing more)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.cli.worker import health_beside
from stepstone.testing import open_engine
from tests.observability.test_metrics_health import _get

held: Workflow[Any] = Workflow("held_in_drain")
entered = asyncio.Event()
release = asyncio.Event()


@held.step(start=True, next=None)
async def hold(ctx: StepContext, state: dict[str, Any]) -> None:
    entered.set()
    await release.wait()


async def test_a_draining_worker_is_alive_and_not_ready(database_url: str) -> None:
    entered.clear()
    release.clear()
    async with open_engine(database_url, Registry(held)) as engine:
        worker = engine.new_worker()
        await worker.start()
        try:
            async with health_beside(worker, engine.store, "127.0.0.1", 0) as server:
                iid = await engine.client.start(held, {})
                await asyncio.wait_for(entered.wait(), 30)
                await worker.stop_claiming()  # what the first SIGTERM does; the step is still running
                assert await _get(server.port, "/livez") == (200, '{"alive": true}')
                status, body = await _get(server.port, "/readyz")
                assert status == 503, body
                assert json.loads(body)["checks"] == {"database": True, "schema": True, "plans": True,
                                                      "claiming": False}
                release.set()
                await worker.stop()
                assert (await engine.client.get(iid)).status == "COMPLETED"  # the drain let it finish
                assert (await _get(server.port, "/livez"))[0] == 503
        finally:
            release.set()
            await worker.stop()
