"""The rig's ledger: every handler of the rig's workflows records its effect here.

The ledger lives in schema ``chaos`` of the engine's database and is written on the handler's own
connection (a small pool per process, not the store's), committed before the handler returns. One row per
handler invocation: ``effect_id`` is fresh per invocation, so a write retried after a lost connection is
not counted twice, while a step that runs again (after a kill or a takeover) adds a row for the same
``key`` (the step's idempotency key): that is a duplicate effect.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import asyncpg

from stepstone.authoring.workflow import CompensationContext, StepContext

# Seconds a handler lingers after its effect and before it returns (the window a kill or pause hits).
PAUSE_ENV = "CHAOS_HANDLER_PAUSE"

LEDGER_DDL = """
CREATE SCHEMA IF NOT EXISTS chaos;
CREATE TABLE IF NOT EXISTS chaos.ledger (
    effect_id uuid PRIMARY KEY,
    key text NOT NULL,
    instance_id uuid NOT NULL,
    step text NOT NULL,
    attempt integer NOT NULL,
    pid integer NOT NULL,
    worker text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS ledger_key ON chaos.ledger (key);
"""


class _Ledger:
    """The per-process ledger pool (the handler's own connections, never the store's)."""

    url: str = ""
    worker: str = ""
    pool: asyncpg.Pool | None = None
    lock: asyncio.Lock | None = None

    async def get(self) -> asyncpg.Pool:
        if self.lock is None:
            self.lock = asyncio.Lock()
        async with self.lock:
            if self.pool is None:
                self.pool = await asyncpg.create_pool(self.url, min_size=1, max_size=4, command_timeout=10)
            return self.pool


LEDGER = _Ledger()


def configure(url: str, worker: str) -> None:
    LEDGER.url = url
    LEDGER.worker = worker


async def record_effect(ctx: StepContext | CompensationContext) -> None:
    """Insert this invocation's ledger row; retry on connection trouble until it is durably there."""
    effect = uuid.uuid4()
    delay = 0.05
    deadline = asyncio.get_running_loop().time() + 120
    while True:
        try:
            pool = await LEDGER.get()
            status = await pool.execute(
                "INSERT INTO chaos.ledger (effect_id, key, instance_id, step, attempt, pid, worker) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (effect_id) DO NOTHING",
                effect, ctx.idempotency_key, uuid.UUID(ctx.instance_id), ctx.step, ctx.attempt, os.getpid(),
                LEDGER.worker,
            )
        except (OSError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError, asyncpg.InternalClientError,
                asyncpg.exceptions.OperatorInterventionError, TimeoutError):
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(delay)  # backoff of the effect's own retry, not a wait for work
            delay = min(delay * 2, 1.0)
        else:
            assert status.startswith("INSERT")
            return
