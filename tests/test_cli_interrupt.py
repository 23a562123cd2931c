"""Ctrl-C on a command: one `error:` line and exit 130 (128 + SIGINT), as the CLI's other errors are one
line; click's own "Aborted!" with exit 1 read like any failure."""

from __future__ import annotations

import asyncio
import os
import signal

import asyncpg
import pytest
from click.testing import CliRunner

from stepstone.cli import cli
from stepstone.store import migrate
from stepstone.store.migrate import advisory_lock_key
from tests._pg import until_shown
from tests.test_cli_worker import DEADLINE, ROOT, STEPSTONE


def _sigint_as_a_terminal_sends_it() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background job's child would start with it ignored


async def test_ctrl_c_on_a_waiting_command_is_one_error_line_and_130(empty_database_url: str) -> None:
    holder = await asyncpg.connect(empty_database_url)
    try:
        # Another migrator holds the lock: `db migrate` polls for it until it is interrupted.
        await holder.execute("SELECT pg_advisory_lock($1)", advisory_lock_key("stepstone"))
        proc = await asyncio.create_subprocess_exec(
            *STEPSTONE, "db", "migrate", "--database-url", empty_database_url, cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_sigint_as_a_terminal_sends_it,
        )
        try:
            await until_shown(holder, "SELECT true FROM pg_stat_activity WHERE datname = current_database() "
                                      "AND query LIKE 'SELECT pg_try_advisory_lock%' AND pid <> pg_backend_pid()",
                              failure="db migrate never waited for the lock")
            proc.send_signal(signal.SIGINT)
            _, err = await asyncio.wait_for(proc.communicate(), DEADLINE)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    finally:
        await holder.close()
    assert proc.returncode == 130, err
    assert err.decode().strip().splitlines()[-1] == "error: interrupted", err
    assert b"Aborted" not in err and b"Traceback" not in err


def test_ctrl_c_on_a_synchronous_command_is_the_same_line_and_130(monkeypatch: pytest.MonkeyPatch) -> None:
    """`db sql` runs no event loop: Ctrl-C in it printed click's "Aborted!" and exited 1."""
    def interrupted(*_: object, **__: object) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(migrate, "pending_sql", interrupted)
    result = CliRunner().invoke(cli, ["db", "sql"])
    assert (result.exit_code, result.stderr.strip()) == (130, "error: interrupted"), result.output
