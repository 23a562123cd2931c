"""``stepstone demo rolling-deploy``: v1 and v2 workers as processes, a v1 outage, nothing stranded for good.

It starts a worker process that has only v1 of the `rollout` workflow and one that has only v2, starts
instances of both versions, stops the v1 worker while its instances wait for a signal, sends every
instance its signal (the v2 worker defers the v1 commands it cannot run), shows the stranded report,
starts a v1 worker again and waits until every instance finished. Every figure it prints is read from
the database: instance statuses, the worker label each `finish` step recorded, the stranded report.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable
from typing import IO, Any

import click

from stepstone.cli.common import CliError, run_async, with_settings
from stepstone.cli.connection import open_store
from stepstone.client import Client
from stepstone.config import Settings
from stepstone.core.model import COMPLETED, FAILED, WAITING
from stepstone.core.pin import pin_of
from stepstone.examples import rolling
from stepstone.store.database import resolve_target
from stepstone.store.port import Store

__all__ = ["demo_rolling_command", "run_rolling_deploy"]

_DEADLINE = 90.0
HEARTBEAT_SECONDS = 0.5
STRANDED_WITHIN = 5.0


class _WorkerProcess:
    """A `stepstone worker` process serving one version, its log kept in a temporary file."""

    def __init__(self, label: str, app: str, url: str, schema: str) -> None:
        self.label, self.app, self.url, self.schema = label, app, url, schema
        self.proc: asyncio.subprocess.Process | None = None
        self.log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()

    async def start(self) -> None:
        env = {**os.environ, "STEPSTONE_WORKER_LABEL": self.label, "PYTHONUNBUFFERED": "1"}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "stepstone", "--app", self.app, "worker", "--database-url", self.url,
            "--schema", self.schema, "--concurrency", "4", "--poll-interval", "0.2",
            "--heartbeat-seconds", str(HEARTBEAT_SECONDS), "--drain-timeout", "5",
            stdin=asyncio.subprocess.DEVNULL, stdout=self.log, stderr=self.log, env=env,
        )

    async def stop(self) -> int | None:
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(20):  # not wait_for: on 3.11 it can lose a cancellation
                return await proc.wait()
        except TimeoutError:
            proc.kill()
            return await proc.wait()

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:]

    def exited(self) -> bool:
        return self.proc is not None and self.proc.returncode is not None


async def _until(what: str, check: Callable[[], Awaitable[bool]], workers: list[_WorkerProcess]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _DEADLINE
    while not await check():
        for w in workers:
            if w.exited():
                raise CliError(f"worker {w.label} exited early:\n{w.tail()}")
        if loop.time() > deadline:
            raise CliError(f"gave up waiting for {what} after {_DEADLINE:g} s")
        await asyncio.sleep(0.1)


async def _serving(store: Store, pins: int) -> bool:
    return len(await store.definitions.served(STRANDED_WITHIN)) >= pins


async def run_rolling_deploy(store: Store, url: str, *, per_version: int = 3) -> dict[str, Any]:
    """Run the scenario on `store` (workers reach it at `url`); returns the figures the last line shows."""
    client = Client(store, rolling.v1_registry)
    v1a = _WorkerProcess("v1-a", "stepstone.examples.rolling:v1_registry", url, store.schema)
    v2w = _WorkerProcess("v2-a", "stepstone.examples.rolling:v2_registry", url, store.schema)
    v1b = _WorkerProcess("v1-b", "stepstone.examples.rolling:v1_registry", url, store.schema)
    everyone = [v1a, v2w, v1b]
    try:
        await v1a.start()
        await v2w.start()
        await _until("the v1 and v2 workers", lambda: _serving(store, 2), [v1a, v2w])
        click.echo(f"workers up: {v1a.label} serves {rolling.DEFINITION} v1, {v2w.label} serves v2")
        ids = {1: [await client.start(rolling.v1, {}) for _ in range(per_version)],
               2: [await client.start(rolling.v2, {}) for _ in range(per_version)]}
        every = ids[1] + ids[2]

        async def all_waiting() -> bool:
            infos = [await client.get(i) for i in every]
            return all(i.status == WAITING and i.step == "await_go" for i in infos)

        await _until("every instance to reach await_go", all_waiting, [v1a, v2w])
        click.echo(f"started {per_version} v1 and {per_version} v2 instance(s); all wait at await_go")
        code = await v1a.stop()
        click.echo(f"stopped worker {v1a.label} (exit {code}); sending go to every instance")
        for i in every:
            await client.signal(i, "go", dedup_key=f"go/{i}")

        async def v2_done_and_v1_deferred() -> bool:
            v2_infos = [await client.get(i) for i in ids[2]]
            stranded = await store.definitions.stranded(STRANDED_WITHIN)
            deferred = sum(s.deferred_commands for s in stranded if s.pin.version == 1)
            return all(i.status == COMPLETED for i in v2_infos) and deferred >= len(ids[1])

        await _until("v2 to finish and the v1 signals to be deferred", v2_done_and_v1_deferred, [v2w])
        stranded = await store.definitions.stranded(STRANDED_WITHIN)
        for s in stranded:
            click.echo(f"stranded: {s.pin.definition_id} v{s.pin.version} (plan {s.pin.plan_hash[:12]}): "
                       f"{s.instances} instance(s), {s.deferred_commands} deferred command(s), no live worker "
                       "serves it")
        failed_meanwhile = [i for i in ids[1] if (await client.get(i)).status == FAILED]
        click.echo(f"v1 instances while no v1 worker runs: {len(ids[1]) - len(failed_meanwhile)} waiting "
                   f"(deferred, not failed), {len(failed_meanwhile)} failed")
        await v1b.start()
        click.echo(f"started worker {v1b.label}")

        async def all_settled() -> bool:
            return all(info.status in (COMPLETED, FAILED) for info in [await client.get(i) for i in every])

        await _until("every instance to finish", all_settled, [v2w, v1b])
        infos = {v: [await client.get(i) for i in ids[v]] for v in (1, 2)}
        stranded_after = await store.definitions.stranded(STRANDED_WITHIN)
        return {
            "failed": sum(i.status == FAILED for v in infos for i in infos[v]),
            "stranded": sum(s.instances for s in stranded_after),
            "v1_on_v1": sum(str(i.state.get("finished_by", "")).startswith("v1") for i in infos[1]),
            "v2_on_v2": sum(str(i.state.get("finished_by", "")).startswith("v2") for i in infos[2]),
            "stranded_during": {s.pin.version: s.instances for s in stranded},
        }
    finally:
        for w in everyone:
            await w.stop()
            w.log.close()
        await client.detach()


async def _demo_rolling(settings: Settings) -> None:
    from stepstone.cli.demo import _migrate  # noqa: PLC0415 - demo imports this module's command

    click.echo(await _migrate(settings))
    target = await asyncio.to_thread(resolve_target, settings)
    async with open_store(settings) as store:
        for wf in (rolling.v1, rolling.v2):  # deployed side by side: both versions must take new instances
            await store.definitions.record(pin_of(wf), wf.plan.document())
        figures = await run_rolling_deploy(store, target.url)
    click.echo(f"rolling-deploy: {figures['failed']} failed, {figures['stranded']} stranded; "
               f"v1 finished {figures['v1_on_v1']} on v1 workers, v2 finished {figures['v2_on_v2']} on v2 workers")


@click.command("rolling-deploy")
@with_settings
def demo_rolling_command(settings: Settings) -> None:
    """Run v1 and v2 workers as processes, stop v1 mid-way, show the stranded report, bring v1 back.

    Nothing fails and nothing is stranded for good: v1 instances wait (deferred) while no v1 worker
    runs, and finish when one returns (docs/versions.md)."""
    run_async(_demo_rolling(settings))

