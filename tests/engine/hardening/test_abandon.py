"""A synchronous handler still running after the drain timeout (issue 9, item 7).

`Worker.stop()` says how many it abandoned, `Worker.abandoned_threads` follows them, and neither
an embedding application nor `stepstone worker` needs a hard exit to finish: the process exits on
its own while the handler is still stuck. Each test failed before the fix (stop returned None;
the embedding process hung until its handler returned; the CLI left through `os._exit`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from stepstone.testing import Engine
from tests.engine.conftest import Rows
from tests.engine.hardening import workflows as hw

ROOT = Path(__file__).resolve().parents[3]
DEADLINE = 30.0




def _step_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("stepstone-step") and t.is_alive()]


_threads_before: list[threading.Thread] = []


@pytest.fixture(autouse=True)
def _remember_threads() -> None:
    _threads_before[:] = _step_threads()


async def test_stop_reports_and_follows_an_abandoned_sync_handler(engine: Engine, rows: Rows) -> None:
    iid = await engine.client.start(hw.held_sync, {})
    gate = hw.GATE[iid] = hw.Gate()
    worker = engine.new_worker(concurrency=2, lease_seconds=30, poll_interval=0.05, worker_id="abandoning")
    await worker.start()
    assert await asyncio.to_thread(gate.entered.wait, DEADLINE)
    assert worker.abandoned_threads == 0  # running, not abandoned

    abandoned = await worker.stop(drain_timeout=0.1)

    assert abandoned == 1 and worker.abandoned_threads == 1
    [thread] = [t for t in _step_threads() if t not in _threads_before]
    assert thread.daemon  # it cannot keep the process alive
    [cmd] = await rows.commands(iid)
    assert cmd["state"] == "PENDING" and cmd["token"] is None  # released: claimable elsewhere at once

    gate.opened.set()
    await asyncio.to_thread(thread.join, DEADLINE)
    assert not thread.is_alive() and worker.abandoned_threads == 0
    info = await engine.client.get(iid)
    assert info.status == "PENDING" and info.state == {"log": []}  # its result was dropped
    await engine.run_until_idle()
    assert (await engine.client.get(iid)).state == {"log": ["held"]}
    assert hw.RUNS[iid, "held_sync_step"] == 2


async def test_stop_returns_0_when_every_step_finished(engine: Engine) -> None:
    worker = engine.new_worker(concurrency=2, lease_seconds=30, poll_interval=0.05)
    await worker.start()
    iid = await engine.client.start(hw.held_sync, {})
    await worker.events.wait_until(lambda: worker.events.commits >= 1, timeout=DEADLINE)
    assert await worker.stop(drain_timeout=5) == 0 and worker.abandoned_threads == 0
    assert (await engine.client.get(iid)).status == "COMPLETED"


async def _run(*argv: str, timeout: float) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
        raise AssertionError(f"process still running after {timeout} s:\n{out.decode()}\n{err.decode()}") from None
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_an_embedding_app_exits_on_its_own_with_a_stuck_handler(engine: Engine, database_url: str) -> None:
    iid = await engine.client.start(hw.stuck, {})
    embedding_app = (sys.executable, "-m", "tests.engine.hardening.abandon_proc", database_url)
    code, out, err = await _run(*embedding_app, timeout=DEADLINE)
    assert code == 0, err
    assert "stop returned 1; abandoned_threads 1" in out
    assert "still running after the drain timeout" in err
    assert (await engine.client.get(iid)).status == "PENDING"  # released, not lost


async def test_cli_worker_exits_0_with_a_stuck_sync_handler(engine: Engine, database_url: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "from stepstone.cli import main; main()", "worker",
        "--app", "tests.engine.hardening.workflows:registry", "--database-url", database_url,
        "--poll-interval", "0.05", "--drain-timeout", "0.1",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    try:
        assert proc.stderr is not None

        async def line_containing(text: str) -> None:
            while True:
                raw = await proc.stderr.readline()  # type: ignore[union-attr]
                assert raw, "worker exited early:\n" + "".join(lines)
                lines.append(raw.decode())
                if text in lines[-1]:
                    return

        await asyncio.wait_for(line_containing("started"), DEADLINE)
        iid = await engine.client.start(hw.stuck, {})
        await asyncio.wait_for(line_containing("stuck handler entered"), DEADLINE)
        proc.send_signal(signal.SIGTERM)
        rest = await asyncio.wait_for(proc.stderr.read(), DEADLINE)
        lines.append(rest.decode())
        assert await asyncio.wait_for(proc.wait(), DEADLINE) == 0
        log = "".join(lines)
        assert "1 claim(s) released" in log
        assert "1 synchronous handler thread(s) abandoned" in log
        assert (await engine.client.get(iid)).status == "PENDING"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
