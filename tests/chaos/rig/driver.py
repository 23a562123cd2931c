"""The people of the rig: while the workers are killed, paused or cut off, a driver completes every open
human task of the workload (`chaostask-1`) and publishes each task instance's `chaos.receipt` message.

Each message is published twice with the same message id: first as soon as its instance exists (its wait
is not open yet, so the message is buffered), then once more after the first answer (a duplicate, which
must change nothing). A completion carries an idempotency key, so a call whose answer was lost (a cut
connection, a restart) is simply made again. The checker then counts what came of it: one completion
per task, one correlated message per instance, no message delivered twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import asyncpg

from stepstone.client import Client
from stepstone.errors import StepstoneError
from stepstone.store.postgres import PostgresStore
from tests.chaos import workflows

_TRANSIENT = (StepstoneError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError)


class TaskDriver:
    def __init__(self, url: str) -> None:
        self.url = url
        self.published: dict[str, int] = {}  # key -> answers received (1: first publish, 2: its repeat)
        self.completions = 0
        self.refusals = 0  # completions answered with a typed refusal (e.g. already COMPLETING by our key)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        store: PostgresStore | None = None
        try:
            while not self._stop.is_set():
                try:
                    if store is None:
                        store = await PostgresStore.open(self.url, max_size=4)
                    await self._round(Client(store, workflows.registry), store)
                except _TRANSIENT:
                    pass  # the server is restarting or the connection was cut: the next round tries again
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 0.1)  # the driver's pace, not a wait for work
        finally:
            if store is not None:
                with contextlib.suppress(Exception):
                    await store.close()

    async def _round(self, client: Client, store: PostgresStore) -> None:
        for task in (await client.tasks(mode="all", limit=100)).tasks:
            if task.status != "OPEN":
                continue
            try:
                await client.complete_task(task.id, "approve", None, actor="rig", admin=True,
                                           idempotency_key=f"rig/{task.id}")
                self.completions += 1
            except StepstoneError:
                self.refusals += 1
        async with store.pool.acquire() as conn:
            keys = [r["key"] for r in await conn.fetch(
                "SELECT state->>'key' AS key FROM stepstone.instances WHERE definition_id = $1", workflows.TASK.id)]
        for key in keys:
            if self.published.get(key, 0) < 2:
                await client.publish_message(workflows.RECEIPT, key, {"key": key}, message_id=f"rig/{key}",
                                             ttl=3600)
                self.published[key] = self.published.get(key, 0) + 1

    def report(self) -> dict[str, Any]:
        return {"driver_completions": self.completions, "driver_refusals": self.refusals,
                "driver_publishes": sum(self.published.values())}
