"""Worker processes of the rig: spawn, SIGKILL, SIGSTOP/SIGCONT, restart, stop; their counters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parents[3]

# The fleets with processes running: a test or scenario that fails before it stops its fleet leaves them to
# `stop_every_fleet` (an autouse fixture calls it after each test), so no worker of a failed test runs on into
# the next and no log file is left open for the collector to warn about there.
_running: dict[int, Fleet] = {}


def stop_every_fleet() -> None:
    for fleet in list(_running.values()):
        fleet.stop(timeout=5.0)


def serves(slot: int, size: int) -> str:
    """What a slot's worker serves (workflows.SERVED_PARTS): in a fleet of four or more, slots 1 and 3 serve
    the chains and the rest of the workflows, the others every workflow, so each workflow has a worker
    whichever slot is down, and the claims of workers that serve some workflows (each served definition's
    own walk) run under every fault."""
    return {1: "chains", 3: "rest"}.get(slot, "all") if size >= 4 else "all"


@dataclass
class Proc:
    slot: int
    popen: subprocess.Popen[bytes]
    stats: Path
    out: TextIO
    started: float

    @property
    def pid(self) -> int:
        return self.popen.pid


@dataclass
class Fleet:
    """`size` worker processes on `url`; a slot whose process is killed can be refilled."""

    url: str
    workdir: Path
    size: int = 4
    lease: float = 2.0
    concurrency: int = 8
    poll: float = 1.0
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[int, Proc] = field(default_factory=dict)
    retired: list[Proc] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)
    slot_urls: dict[int, str] = field(default_factory=dict)  # a slot's own URL (e.g. its own proxy)
    parts: dict[int, str] = field(default_factory=dict)  # what a slot serves, where not `serves`' choice
    # The process each slot runs: the engine's worker, or the rig's external-task worker (same arguments).
    module: str = "tests.chaos.worker_proc"
    _serial: int = 0

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for slot in range(self.size):
            self.spawn(slot)

    def spawn(self, slot: int) -> Proc:
        self._serial += 1
        stats = self.workdir / f"worker-{self._serial}.json"
        out = (self.workdir / f"worker-{self._serial}.log").open("w")
        env = {**os.environ, **self.env, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        url = self.slot_urls.get(slot, self.url)
        cmd = [sys.executable, "-m", self.module, "--url", url, "--lease", str(self.lease),
               "--concurrency", str(self.concurrency), "--poll", str(self.poll), "--name", f"w{slot}",
               "--stats", str(stats), "--serve", self.parts.get(slot) or serves(slot, self.size)]
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        proc = Proc(slot, popen, stats, out, time.monotonic())
        self.procs[slot] = proc
        _running[id(self)] = self
        return proc

    def kill(self, slot: int) -> dict[str, Any]:
        """SIGKILL the slot's process and start a new one in its place."""
        proc = self.procs[slot]
        at = time.time()
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait()
        proc.out.close()
        self.retired.append(proc)
        record = {"pid": proc.pid, "at": at}
        self.kills.append(record)
        self.spawn(slot)
        return record

    def pause(self, slot: int) -> None:
        self.procs[slot].popen.send_signal(signal.SIGSTOP)

    def resume(self, slot: int) -> None:
        self.procs[slot].popen.send_signal(signal.SIGCONT)

    def alive(self) -> bool:
        return all(p.popen.poll() is None for p in self.procs.values())

    def stop(self, timeout: float = 30.0) -> None:
        for proc in self.procs.values():
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGCONT)
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
            proc.out.close()
        self.retired.extend(self.procs.values())
        self.procs = {}
        _running.pop(id(self), None)

    def stats(self) -> list[dict[str, Any]]:
        """The last counters of every process that ran (killed ones: their last periodic dump)."""
        docs = []
        for proc in [*self.retired, *self.procs.values()]:
            try:
                doc = json.loads(proc.stats.read_text())
            except (OSError, ValueError):
                doc = {"pid": proc.pid, "claims": 0, "commits": 0, "fenced": 0, "released": 0,
                       "unknown_outcome": 0, "warnings": 0, "fenced_log": [], "final": False}
            doc["exit"] = proc.popen.returncode
            docs.append(doc)
        return docs

    def crashed(self) -> list[int]:
        """Pids that exited on their own with an error (not killed by us, not stopped cleanly)."""
        killed = {k["pid"] for k in self.kills}
        return [p.pid for p in self.retired
                if p.pid not in killed and p.popen.returncode not in (0, None, -signal.SIGTERM)]
