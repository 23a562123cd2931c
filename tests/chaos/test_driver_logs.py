"""A PostgreSQL restart leaves one line per event on the operator's stderr, never a driver traceback:
asyncpg's pool logs a traceback each time it fails to restore its connection floor, and stepstone folds
it into one line (``stepstone.store.database.install_one_line_driver_logs``)."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from pathlib import Path

from tests.chaos.rig.scenarios import create_database, drop_database
from tests.chaos.rig.server import RigServer

ROOT = Path(__file__).resolve().parents[2]
DRIVER_LINE = "Failed to restore the pool connection floor"
CLIENT = """
import asyncio, sys
from stepstone.store.postgres import PostgresStore

async def main() -> None:
    store = await PostgresStore.open(sys.argv[1])
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await store.close()

asyncio.run(main())
"""


async def _spawn(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *args, cwd=ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def _line_with(stream: asyncio.StreamReader, text: str, seen: list[str]) -> None:
    while True:
        raw = await stream.readline()
        assert raw, f"exited before printing {text!r}:\n{''.join(seen)}"
        seen.append(raw.decode(errors="replace"))
        if text in seen[-1]:
            return


async def test_a_restart_prints_no_driver_traceback(rig_pg: RigServer) -> None:
    db = f"driverlogs_{uuid.uuid4().hex[:8]}"
    url = await create_database(rig_pg.url(), db)
    client = await _spawn(sys.executable, "-c", CLIENT, url)
    worker = await _spawn(sys.executable, "-c", "from stepstone.cli import main; main()", "worker",
                          "--app", "tests.cli_apps:registry", "--database-url", url, "--poll-interval", "0.2")
    err: dict[str, list[str]] = {"client": [], "worker": []}
    try:
        assert client.stdout is not None and client.stderr is not None and worker.stderr is not None
        assert (await asyncio.wait_for(client.stdout.readline(), 30)).strip() == b"ready"
        await asyncio.wait_for(_line_with(worker.stderr, "started", err["worker"]), 30)
        await asyncio.to_thread(rig_pg.stop, "immediate")
        try:  # both pools lose their connections and fail to restore them while the server is down
            await asyncio.wait_for(asyncio.gather(_line_with(client.stderr, DRIVER_LINE, err["client"]),
                                                  _line_with(worker.stderr, DRIVER_LINE, err["worker"])), 30)
        finally:
            await asyncio.to_thread(rig_pg.start)
    finally:
        assert client.stdin is not None
        client.stdin.write(b"\n")
        worker.terminate()
        for name, proc in (("client", client), ("worker", worker)):
            assert proc.stderr is not None
            rest = await asyncio.wait_for(proc.stderr.read(), 30)
            err[name].append(rest.decode(errors="replace"))
            await asyncio.wait_for(proc.wait(), 30)
        await drop_database(rig_pg.url(), db)
    for name, chunks in err.items():
        text = "".join(chunks)
        assert "Traceback" not in text, f"{name} stderr:\n{text}"
        failed = [line for line in text.splitlines() if DRIVER_LINE in line]
        assert failed, f"{name} stderr:\n{text}"
        assert all("(" in line and line.rstrip().endswith(")") for line in failed), failed  # the cause, inline
