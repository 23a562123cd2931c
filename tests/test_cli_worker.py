"""``stepstone worker`` as a real process: it runs work, drains on SIGTERM, dies on a second signal.

Every wait has a deadline and ends on something observable (a log line, an instance status),
never on a fixed sleep.
"""

from __future__ import annotations

import asyncio
import os
import re
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


async def spawn(*args: str, env: dict[str, str] | None = None) -> WorkerProcess:
    """`stepstone *args` as a process whose stderr lines a test waits on (its stdin a pipe the test may write)."""
    proc = await asyncio.create_subprocess_exec(
        *STEPSTONE, *args, cwd=ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
    )
    return WorkerProcess(proc)


async def start_worker(database_url: str, *args: str) -> WorkerProcess:
    return await spawn("worker", "--app", "tests.cli_apps:registry", "--database-url", database_url,
                       "--poll-interval", "0.2", *args)


@pytest.fixture
async def client(database_url: str) -> AsyncIterator[Client]:
    store = await PostgresStore.open(database_url)
    client = Client(store, cli_apps.registry)
    yield client
    await client.detach()  # its LISTEN connection, if a wait opened one
    await store.close()


async def step_in_flight(worker: WorkerProcess, instance_id: str) -> None:
    """Until the worker's handler of the instance's step has begun (it says so on stderr)."""
    await worker.line_containing(f"step of {instance_id} in flight")


async def test_runs_work_and_exits_0_on_sigterm(database_url: str, client: Client) -> None:
    worker = await start_worker(database_url, "--concurrency", "3", "--drain-timeout", "5")
    try:
        started = await worker.line_containing("started")
        assert "concurrency 3" in started and "workflows hello v1" in started
        instance_id = await client.start("hello", {"name": "w"})
        done = await client.wait_for(instance_id, timeout=DEADLINE)  # wakes on the instance's settle notification
        assert (done.status, done.state["greeting"]) == ("COMPLETED", "hello w")
        worker.proc.send_signal(signal.SIGTERM)
        await worker.line_containing("SIGTERM received: draining")
        assert await worker.exit_code(timeout=5 + 5) == 0
        assert "drained: 0 claim(s) released" in "".join(worker.lines)
    finally:
        if worker.proc.returncode is None:
            worker.proc.kill()
            await worker.proc.wait()


async def test_drain_finishes_in_flight_steps(database_url: str, client: Client) -> None:
    worker = await start_worker(database_url, "--drain-timeout", "20")
    try:
        await worker.line_containing("started")
        instance_id = await client.start("held", {})
        await step_in_flight(worker, instance_id)
        worker.proc.send_signal(signal.SIGTERM)
        await worker.line_containing("draining 1 in-flight step(s)")  # the step is held: still in flight
        assert worker.proc.stdin is not None
        worker.proc.stdin.write(b"release\n")  # let it finish inside the drain
        await worker.proc.stdin.drain()
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
        await step_in_flight(worker, instance_id)
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
        await step_in_flight(worker, instance_id)
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


@pytest.mark.parametrize("every", ["0s", "0.5s", "0m"])
def test_retention_every_has_a_minimum(every: str) -> None:
    from click.testing import CliRunner  # noqa: PLC0415

    from stepstone.cli import cli  # noqa: PLC0415

    # An unreachable database: without the check the worker would try it and fail with exit 1, not hang.
    result = CliRunner().invoke(cli, ["worker", "--app", "tests.cli_apps:registry", "--database-url",
                                      "postgresql://u@127.0.0.1:1/db", "--retention-every", every])
    assert result.exit_code == 2, result.output
    assert "--retention-every" in result.stderr and "at least 1s" in result.stderr
    helped = CliRunner().invoke(cli, ["worker", "--help"], terminal_width=200).stdout
    assert re.search(r"--retention-every DURATION .*x>=1s", helped), helped


def test_serve_and_metrics_on_one_port_is_refused_before_anything_starts() -> None:
    from click.testing import CliRunner  # noqa: PLC0415

    from stepstone.cli import cli  # noqa: PLC0415

    # An unreachable database: a worker that started anyway fails on it with exit 1.
    result = CliRunner().invoke(cli, ["worker", "--app", "tests.cli_apps:registry", "--database-url",
                                      "postgresql://u@127.0.0.1:1/db", "--serve", "--no-auth", "--port", "8861",
                                      "--metrics-port", "8861"])
    assert result.exit_code == 2, result.output
    assert "Error: Invalid value for '--metrics-port': 8861 is --port too" in result.stderr, result.stderr
    assert "serving" not in result.stderr and "cannot reach" not in result.stderr


def test_serve_and_metrics_on_one_port_of_two_addresses_is_let_through() -> None:
    """It was refused whatever the hosts; two addresses can each listen on the port. The worker goes on
    (to the unreachable database, exit 1), where the same address or a wildcard is refused (exit 2)."""
    from click.testing import CliRunner  # noqa: PLC0415

    from stepstone.cli import cli  # noqa: PLC0415

    def worker(host: str, metrics_host: str) -> tuple[int, str]:
        result = CliRunner().invoke(cli, [
            "worker", "--app", "tests.cli_apps:registry", "--database-url", "postgresql://u@127.0.0.1:1/db",
            "--serve", "--no-auth", "--host", host, "--port", "8861", "--metrics-host", metrics_host,
            "--metrics-port", "8861"])
        return result.exit_code, result.stderr

    code, err = worker("127.0.0.1", "127.0.0.2")
    assert code == 1 and "is --port too" not in err, err
    for host, metrics_host in (("127.0.0.1", "127.0.0.1"), ("127.0.0.1", "0.0.0.0"), ("::", "::1"),  # noqa: S104
                               ("::1", "[::1]"), ("localhost", "LOCALHOST")):
        code, err = worker(host, metrics_host)
        assert code == 2 and "8861 is --port too" in err, (host, metrics_host, err)


@pytest.mark.parametrize("given", [["--catalog", "stepstone.examples.document_catalog:catalog"], ["--port", "8862"],
                                   ["--host", "0.0.0.0"], ["--read-only"], ["--no-auth"]])  # noqa: S104
def test_an_option_of_the_api_without_serve_is_refused(given: list[str]) -> None:
    """`worker --catalog X` without --serve started the worker and ignored the catalog (and so for every
    option of the API it serves only with --serve): refused before anything starts, saying what to pass."""
    from click.testing import CliRunner  # noqa: PLC0415

    from stepstone.cli import cli  # noqa: PLC0415

    # An unreachable database: a worker that started anyway fails on it with exit 1.
    result = CliRunner().invoke(cli, ["worker", "--app", "tests.cli_apps:registry", "--database-url",
                                      "postgresql://u@127.0.0.1:1/db", *given])
    assert result.exit_code == 2, result.output
    said = (f"Error: Invalid value for '{given[0]}': it is an option of the management API and UI, which this "
            f"worker serves only with --serve: pass --serve too, or leave {given[0]} out")
    assert said in result.stderr, result.stderr
