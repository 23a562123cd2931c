"""The operator CLI: tables and -o json on every command, the same filters everywhere, one-line errors."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from click.testing import CliRunner, Result

from stepstone.cli import cli
from stepstone.testing import Engine
from tests.ops import workflows


def _cli(database_url: str, *args: str) -> Result:
    return CliRunner().invoke(cli, ["--database-url", database_url, *args])


async def run(database_url: str, *args: str) -> Result:
    return await asyncio.to_thread(_cli, database_url, *args)


async def as_json(database_url: str, *args: str) -> Any:
    result = await run(database_url, *args, "-o", "json")
    assert result.exit_code in (0, 3, 4), result.output
    return json.loads(result.stdout)


async def _failed(engine: Engine, n: int) -> list[str]:
    ids = [await engine.client.start(workflows.flaky, {"name": f"order-{k}"}, business_key=f"order-{k}")
           for k in range(n)]
    await workflows.failed_for_good(engine, *ids)
    return ids


async def test_find_inspect_history_and_stuck(engine: Engine, database_url: str) -> None:
    failed = await _failed(engine, 3)
    ok = await engine.client.start(workflows.flaky, {}, business_key="invoice-9")
    await engine.run_until_idle()
    table = await run(database_url, "find", "--status", "FAILED", "--count")
    assert table.exit_code == 0, table.output
    assert all(i in table.stdout for i in failed) and ok not in table.stdout
    assert "3 FAILED (3 in all)" in table.stdout
    data = await as_json(database_url, "find", "--key-contains", "ORDER-1")
    assert [i["id"] for i in data["instances"]] == [failed[1]]
    page = await as_json(database_url, "find", "--workflow", "ops_flaky", "--limit", "2")
    rest = await as_json(database_url, "find", "--workflow", "ops_flaky", "--limit", "2",
                         "--after", page["next_cursor"])
    assert len(page["instances"]) == 2 and len(rest["instances"]) == 2 and rest["next_cursor"] is None
    assert (await as_json(database_url, "find", "--since", "1h", "--updated-until", "2h"))["instances"] == []
    detail = await as_json(database_url, "inspect", failed[0])
    assert detail["status"] == "FAILED" and detail["positions"][0]["status"] == "FAILED"
    table = await run(database_url, "inspect", failed[0])  # the error was in -o json only
    assert [line.split(None, 1)[1] for line in table.stdout.splitlines() if line.startswith("error ")] == [
        "Busy: down for good (step work, attempt 5)"]
    history = await run(database_url, "history", failed[0], "--failed")
    assert history.exit_code == 0 and "STEP_FAILED" in history.stdout and "worker" in history.stdout
    stuck = await as_json(database_url, "stuck", "--older-than", "1m")
    assert {i["reason"] for i in stuck["items"]} <= {"old", "dead letter", "retrying"}
    # A bare number is seconds, as every duration option takes it (it was "not a duration like 90s ...")
    assert await as_json(database_url, "stuck", "--older-than", "60") == stuck
    probe = await run(database_url, "probe")
    assert probe.exit_code == 0 and probe.stdout.startswith("idle")


async def test_list_stuck_and_probe_take_the_filters_of_find(engine: Engine, database_url: str) -> None:
    a, b = [await engine.client.start(workflows.flaky, {}, business_key=k) for k in ("fil-a", "fil-b")]
    for iid in (a, b):
        workflows.FAILURES[iid] = 2
    await engine.run_until_idle()  # both wait out a retry backoff
    fresh = await engine.client.start(workflows.flaky, {}, business_key="fil-c")  # claimable, not run
    try:
        stuck = await as_json(database_url, "stuck", "--business-key", "fil-a")
        assert [(i["instance_id"], i["reason"]) for i in stuck["items"]] == [(a, "retrying")]
        assert {i["instance_id"] for i in (await as_json(database_url, "stuck", "--key-contains", "FIL-"))["items"]} \
            == {a, b}
        assert (await run(database_url, "stuck", "--workflow", "ops_forky")).stdout.strip() == "nothing stuck"
        idle = await run(database_url, "probe", "--business-key", "fil-a")
        assert idle.exit_code == 0 and idle.stdout.startswith("idle"), idle.output
        busy = await as_json(database_url, "probe", "--business-key", "fil-c")
        assert [c["instance_id"] for c in busy["claimable"]] == [fresh]
        assert (await run(database_url, "probe")).exit_code == 3  # all of them: fil-c can be claimed
        both = await as_json(database_url, "list", "--status", "PENDING", "--status", "RUNNING",
                             "--key-contains", "fil-")
        assert {i["id"] for i in both["instances"]} == {a, b, fresh}
        assert [i["id"] for i in (await as_json(database_url, "list", "--business-key", "fil-c"))["instances"]] \
            == [fresh]
    finally:
        for iid in (a, b):
            workflows.FAILURES.pop(iid, None)


async def test_repair_retention_and_replay_from_the_cli(engine: Engine, database_url: str) -> None:
    failed = await _failed(engine, 2)
    dry = await as_json(database_url, "repair", "retry", "--status", "FAILED", "--dry-run")
    assert (dry["dry_run"], dry["matched"], dry["items"]) == (True, 2, [])
    report = await as_json(database_url, "repair", "retry", "--status", "FAILED", "--actor", "pat")
    assert (report["matched"], report["succeeded"]) == (2, 2)
    again = await run(database_url, "repair", "retry", *failed)
    assert again.exit_code == 4 and "only a FAILED or COMPENSATION_FAILED instance can be retried" in again.stdout
    said = await run(database_url, "repair", "retry", "--status", "COMPLETED", "--dry-run")  # 'would apply to'
    assert said.stdout.strip() == ("dry run: 0 instance(s) selected for retry (a retry takes only FAILED and "
                                   "COMPENSATION_FAILED ones)")
    await engine.run_until_idle()
    policies = await as_json(database_url, "retention", "policies")
    assert {(p["workflow"], p["status_class"]) for p in policies} >= {("*", "completed"), ("*", "failed")}
    dry_run = await run(database_url, "retention", "run", "--dry-run")
    assert dry_run.exit_code == 0 and "would archive" in dry_run.stdout
    set_policy = await run(database_url, "retention", "set", "ops_flaky", "completed", "never")
    assert set_policy.exit_code == 0 and "archive after never" in set_policy.stdout
    outbox = await run(database_url, "retention", "set", "*", "outbox_published", "1s")
    assert (outbox.exit_code, outbox.stdout.strip()) == (0, ("* outbox_published: published outbox rows dropped "
                                                            "after 1 s"))
    listed = await run(database_url, "retention", "policies")
    [line] = [ln for ln in listed.stdout.splitlines() if "outbox_published" in ln]
    assert "dropped after 1 s" in line and "later" not in line
    refused = await run(database_url, "retention", "set", "ops_flaky", "outbox_published", "1s")
    assert refused.exit_code == 1 and refused.stderr.startswith("error: outbox_published takes only the '*'")
    unknown = await run(database_url, "retention", "set", "nosuchwf", "completed", "1d")
    assert unknown.exit_code == 1 and unknown.stderr.startswith("error: no workflow 'nosuchwf' is registered")
    replayed = await as_json(database_url, "replay", "--instance", failed[0], "--from", "work")
    assert replayed["from_step"] == "work" and replayed["status"] == "RUNNING"


async def test_bad_arguments_are_one_line_errors(database_url: str) -> None:
    for args, message in (
        (["repair", "retry"], "give instance ids or at least one filter"),
        (["find", "--since", "yesterday"], "neither an ISO 8601 time nor a duration"),
        (["find", "--since", "10000000w"], "longer than a thousand years"),  # before year 1: no instant
        (["find", "--until", "0001-01-01T00:00:00+00:01"], "--until '0001-01-01T00:00:00+00:01' is outside the"),
        (["inspect", "nope"], "'nope' is not an instance id (expected a UUID)"),
        (["find", "--parent", "zz"], "'zz' is not an instance id for --parent (expected a UUID)"),
        (["replay", "--instance", "00000000-0000-0000-0000-000000000000", "--from", "work"], "no instance"),
    ):
        result = await run(database_url, *args)
        assert result.exit_code == 1, (args, result.output)
        assert result.stderr.strip().startswith("error: ") and message in result.stderr
        assert "Traceback" not in result.output
    for args, message in (  # a duration is refused as a usage error, as every duration option refuses one
        (["stuck", "--older-than", "soon"], "'soon' is not a duration: give seconds (90) or 90s, 15m, 2h, 30d, 1w"),
        (["stuck", "--older-than", "9999999d"], "longer than a thousand years"),  # now - it: out of range
        (["stuck", "--older-than", "99999999999999d"], "longer than a thousand years"),  # no timedelta holds it
        (["retention", "set", "*", "completed", "99999999999d"], "longer than a thousand years"),
    ):
        result = await run(database_url, *args)
        assert result.exit_code == 2 and message in result.stderr, (args, result.output)
        assert "Traceback" not in result.output


async def test_replay_of_a_branch_step_says_its_fork_runs_again(engine: Engine, database_url: str) -> None:
    iid = await engine.client.start(workflows.forky, {})
    workflows.FAILURES[iid] = 1  # finish, after the join, fails once
    await engine.run_until_idle()
    result = await run(database_url, "replay", "--instance", iid, "--from", "right")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("step right ran in a branch of fork split, so every branch runs again; "
                                    f"replaying {iid} from step split")
