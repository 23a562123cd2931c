"""Starting and reading `worker_proc` subprocesses."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

URL_ENV = "STEPSTONE_BENCH_DATABASE_URL"
"""The child's database URL travels in its environment (private to the user), not on its command line."""


def worker_command(url: str, schema: str, *options: str) -> tuple[list[str], dict[str, str]]:
    """The child's arguments and environment; the URL, with any password, is only in the environment."""
    args = [sys.executable, "-m", "stepstone.bench.worker_proc", "--schema", schema, *options]
    return args, {**os.environ, URL_ENV: url}


class WorkerProcess:
    """One `python -m stepstone.bench.worker_proc` child; `expect` reads its JSON report lines."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def spawn(cls, url: str, schema: str, *options: str) -> WorkerProcess:
        args, env = worker_command(url, schema, *options)
        proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE, env=env)
        return cls(proc)

    async def expect(self, event: str, timeout: float = 60.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
            if not line:
                raise RuntimeError(f"worker process exited ({self.proc.returncode}) before reporting {event!r}")
            data: dict[str, Any] = json.loads(line)
            if data.get("event") == event:
                return data

    async def terminate(self, timeout: float = 30.0) -> dict[str, Any] | None:
        """SIGTERM (drain) and read the exit report; SIGKILL when it does not exit in time."""
        if self.proc.returncode is not None:
            return None
        self.proc.send_signal(signal.SIGTERM)
        try:
            report = await self.expect("exit", timeout)
            await asyncio.wait_for(self.proc.wait(), timeout)
        except (TimeoutError, RuntimeError):
            self.kill()
            await self.proc.wait()
            return None
        return report

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
