"""``stepstone demo``: migrates, runs the order example through a step, a timer and a signal, exits 0."""

from __future__ import annotations

import re

from click.testing import CliRunner

from stepstone.cli import cli
from stepstone.cli.demo import narrate
from stepstone.store.migrate import shipped_migrations


def test_demo_runs_the_order_to_completion(empty_database_url: str) -> None:
    result = CliRunner().invoke(cli, ["demo", "--database-url", empty_database_url], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert f"schema stepstone: applied {len(shipped_migrations())} migration(s)" in lines[0]
    tag = re.match(r"\[order o-[0-9a-f]+\]", lines[1])
    assert tag is not None, lines[1]
    narrated = [line.removeprefix(tag.group(0) + " ") for line in lines[2:]]
    assert narrated[:-1] == [
        "started at step reserve_stock",
        "step reserve_stock completed",
        "waiting at timer cooling_off (2 s)",
        "timer cooling_off fired",
        "waiting at await_payment for signal order_cancelled or payment_received",
        narrated[5],
        "signal payment_received accepted at await_payment",
        "step ship completed",
        "step send_receipt completed",
        "instance completed",
    ]
    assert narrated[5].startswith("sent signal payment_received ")
    assert narrated[-1].startswith("done: outcome shipped, reservation res-")


def test_demo_runs_again_on_a_migrated_database(database_url: str) -> None:
    result = CliRunner().invoke(cli, ["demo", "--database-url", database_url], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "schema stepstone: up to date" in result.stdout.splitlines()[0]
    assert "instance completed" in result.stdout


def test_narration_of_other_entries() -> None:
    assert narrate({"kind": "STEP_COMPLETED", "step": "s", "data": {"attempt": 3}}) == "step s completed (attempt 3)"
    assert narrate({"kind": "INSTANCE_CANCELLED", "step": None, "data": None}) == "instance cancelled"
    assert narrate({"kind": "WAIT_TIMED_OUT", "step": "w", "data": {}}) == "wait timed out at w"


def test_demo_fanout_runs_branches_in_parallel_then_a_child(database_url: str) -> None:
    result = CliRunner().invoke(cli, ["demo", "fanout", "--database-url", database_url], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    last = result.stdout.splitlines()[-1]
    match = re.fullmatch(r"fanout: 10 branches x 1\.0 s in (\d+\.\d\d) s; child ([0-9a-f-]{36}) completed", last)
    assert match is not None, last  # how long it took is the bench's to report (stepstone bench --only fanout)
    assert "join fired 1 time(s)" in result.stdout


def test_demo_approval_escalates_and_correlates_the_receipt(database_url: str) -> None:
    result = CliRunner().invoke(cli, ["demo", "approval", "--database-url", database_url], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    match = re.fullmatch(r"approval: APPROVED by lee after escalation; receipt correlated to ([0-9a-f-]{36})",
                         lines[-1])
    assert match is not None, lines[-1]
    assert match.group(1) in lines[1]  # the instance the demo started
    narrated = [line.split("] ", 1)[1] for line in lines[2:-1]]
    assert narrated.index("reminder sent (nobody acted yet)") < narrated.index(
        "due date passed: escalated to group finance-leads") < narrated.index("task claimed by lee")
    assert "published receipt_received: delivered" in narrated
