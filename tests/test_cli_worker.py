"""``stepstone worker`` as a real process: it runs work, drains on SIGTERM, dies on a second signal.

Every wait has a deadline and ends on something observable (a log line, an instance status),
never on a fixed sleep.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from stepstone.client import Client
from stepstone.store.postgres import PostgresStore
from tests import cli_apps

ROOT = Path(__file__).resolve().parent.parent
STEPSTONE = (sys.executable, "-c", "from stepstone.cli import main; main()")  # the console script, wherever installed
DEADLINE = 30.0


class WorkerProcess:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []

    async def line_containing(self, text: str, timeout: float = DEADLINE) -> str:
        """The next stderr line containing ``text``."""
        assert self.proc.stderr is not None

        async def find() -> str:
            while True:
                raw = await self.proc.stderr.readline()  # type: ignore[union-attr]
                if not raw:
                    raise AssertionError(f"worker exited before logging {text!r}:\n" + "".join(self.lines))
                line = raw.decode()
                self.lines.append(line)
                if text in line:
                    return line

        return await asyncio.wait_for(find(), timeout)

    async def exit_code(self, timeout: float) -> int:
        assert self.proc.stderr is not None
        rest = await asyncio.wait_for(self.proc.stderr.read(), timeout)
        self.lines.append(rest.decode())
        return await asyncio.wait_for(self.proc.wait(), timeout)


async def start_worker(database_url: str, *args: str) -> WorkerProcess:
    proc = await asyncio.create_subprocess_exec(
        *STEPSTONE, "worker", "--app", "tests.cli_apps:registry", "--database-url", database_url,
        "--poll-interval", "0.2", *args,
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return WorkerProcess(proc)


@pytest.fixture
async def client(database_url: str) -> AsyncIterator[Client]:
    store = await PostgresStore.open(database_url)
    yield Client(store, cli_apps.registry)
    await store.close()


async def wait_for_status(client: Client, instance_id: str, *statuses: str) -> str:
    """Poll the instance's status until it is one of ``statuses`` (with a deadline)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while (status := await client.store.status(instance_id)) not in statuses:
        assert loop.time() < deadline, f"instance {instance_id} still {status}"
        await asyncio.sleep(0.02)
    return status


async def wait_for_claim(client: Client, instance_id: str) -> None:
    """Poll until a worker holds the instance's command (its step is in flight)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    async with client.store.pool.acquire() as conn:
        while not await conn.fetchval(
            "SELECT count(*) FROM stepstone.commands WHERE instance_id = $1 AND state = 'CLAIMED'",
            uuid.UUID(instance_id),
        ):
            assert loop.time() < deadline, "the worker never claimed the instance"
            await asyncio.sleep(0.02)


async def test_runs_work_and_exits_0_on_sigterm(database_url: str, client: Client) -> None:
    worker = await start_worker(database_url, "--concurrency", "3", "--drain-timeout", "5")
    try:
        started = await worker.line_containing("started")
        assert "concurrency 3" in started and "workflows hello v1" in started
        instance_id = await client.start("hello", {"name": "w"})
        assert await wait_for_status(client, instance_id, "COMPLETED", "FAILED") == "COMPLETED"
        assert (await client.get(instance_id)).state["greeting"] == "hello w"
        worker.proc.send_signal(signal.SIGTERM)
        await worker.line_containing("SIGTERM received: draining")
        assert await worker.exit_code(timeout=5 + 5) == 0
        assert "drained: 0 claim(s) released" in "".join(worker.lines)
    finally:
        if worker.proc.returncode is None:
            worker.proc.kill()
            await worker.proc.wait()


async def test_drain_finishes_in_flight_steps(database_url: str, client: Client, tmp_path: Path) -> None:
    worker = await start_worker(database_url, "--drain-timeout", "20")
    release = tmp_path / "release"
    try:
        await worker.line_containing("started")
        instance_id = await client.start("held", {"release": str(release)})
        await wait_for_claim(client, instance_id)
        worker.proc.send_signal(signal.SIGTERM)
        await worker.line_containing("draining 1 in-flight step(s)")  # the step is held: still in flight
        release.touch()  # let it finish inside the drain
        assert await worker.exit_code(timeout=20 + 5) == 0
        assert await client.store.status(instance_id) == "COMPLETED"
        assert (await client.get(instance_id)).state["done"] is True  # finished by the draining worker
    finally:
        if worker.proc.returncode is None:
            worker.proc.kill()
            await worker.proc.wait()


async def test_drain_timeout_releases_the_claim(database_url: str, client: Client) -> None:
    worker = await start_worker(database_url, "--drain-timeout", "0.5")
    try:
        await worker.line_containing("started")
        instance_id = await client.start("slow", {"seconds": 120})
        await wait_for_claim(client, instance_id)
        worker.proc.send_signal(signal.SIGINT)
        assert await worker.exit_code(timeout=0.5 + 10) == 0
        assert "1 claim(s) released" in "".join(worker.lines)
        async with client.store.pool.acquire() as conn:
            states = await conn.fetch("SELECT state FROM stepstone.commands WHERE instance_id = $1",
                                      uuid.UUID(instance_id))
        assert [r["state"] for r in states] == ["PENDING"]  # claimable by another worker at once
    finally:
        if worker.proc.returncode is None:
            worker.proc.kill()
            await worker.proc.wait()


async def test_second_signal_exits_at_once(database_url: str, client: Client) -> None:
    worker = await start_worker(database_url, "--drain-timeout", "120")
    try:
        await worker.line_containing("started")
        instance_id = await client.start("slow", {"seconds": 120})
        await wait_for_claim(client, instance_id)
        worker.proc.send_signal(signal.SIGTERM)
        await worker.line_containing("draining")
        worker.proc.send_signal(signal.SIGINT)
        assert await worker.exit_code(timeout=10) == 128 + signal.SIGINT
        assert "second SIGINT: exiting now" in "".join(worker.lines)
    finally:
        if worker.proc.returncode is None:
            worker.proc.kill()
            await worker.proc.wait()


async def test_unmigrated_database_refuses_to_start(empty_database_url: str) -> None:
    worker = await start_worker(empty_database_url)
    code = await worker.exit_code(timeout=DEADLINE)
    out = "".join(worker.lines).strip().splitlines()
    assert code == 1
    assert len(out) == 1 and out[0].startswith("error: ") and "run `stepstone db migrate` first" in out[0]
