"""``stepstone tasks ...`` and ``stepstone messages publish`` against real PostgreSQL: the inbox, claim,
complete, reassign, delegate, bulk reassign, one-line errors, -o json."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from click.testing import CliRunner, Result

from stepstone.cli import cli
from stepstone.testing import open_engine
from tests.crashes import die_alone
from tests.engine.task_workflows import Expense, Receipt, callback, expense, receipt, registry

APP = "tests.engine.task_workflows:registry"


class Cli:
    def __init__(self, url: str) -> None:
        self.url = url

    def __call__(self, *args: str) -> Result:
        return CliRunner().invoke(cli, ["--database-url", self.url, *args], catch_exceptions=False)

    def json(self, *args: str) -> Any:
        result = self(*args, "-o", "json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    def error(self, *args: str) -> str:
        result = self(*args)
        assert result.exit_code == 1, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        return lines[0]


def _run(url: str, *starts: tuple[Any, Any]) -> list[str]:
    async def go() -> list[str]:
        async with open_engine(url, registry) as engine:
            ids = [await engine.client.start(wf, data) for wf, data in starts]
            await engine.run_until_idle()
            return ids

    return asyncio.run(go())


def test_tasks_from_the_inbox_to_completion(database_url: str) -> None:
    cli = Cli(database_url)
    [iid] = _run(database_url, (expense, Expense(expense_id="c-1", employee="eve", amount=9)))
    listed = cli.json("tasks", "list", "--user", "alice", "--group", "finance")
    [task] = listed["tasks"]
    tid = task["id"]
    assert task["instance_id"] == iid and listed["next_cursor"] is None
    assert cli.json("tasks", "count", "--user", "alice", "--group", "finance") == {"count": 1}
    assert cli.json("tasks", "count", "--mode", "all", "--text", "c-1") == {"count": 1}
    table = cli("tasks", "list", "--user", "alice", "--group", "finance").stdout
    assert "Approve expense c-1 of eve" in table and "group:finance" in table
    assert cli.json("tasks", "claim", tid, "--as", "alice", "--group", "finance")["assignee"] == "alice"
    assert "held by alice" in cli.error("tasks", "claim", tid, "--as", "bob", "--group", "finance")
    assert "no decision 'maybe'" in cli.error("tasks", "complete", tid, "maybe", "--as", "alice")
    assert "missing comment" in cli.error("tasks", "complete", tid, "approve", "--as", "alice", "--payload", "{}")
    assert "invalid: comment" in cli.error("tasks", "complete", tid, "approve", "--as", "alice", "--payload",
                                           '{"comment": 5}', "--app", APP)
    assert "who does this" in cli.error("tasks", "claim", tid)
    assert "no task" in cli.error("tasks", "show", "not-a-task")
    delegated = cli.json("tasks", "delegate", tid, "dave", "--as", "alice", "--reason", "away")
    assert (delegated["assignee"], delegated["delegation"]) == ("dave", "PENDING")
    assert cli.json("tasks", "resolve", tid, "--as", "dave")["assignee"] == "mia"
    moved = cli("tasks", "reassign-all", "mia", "alice", "--as", "boss", "--dry-run")
    assert moved.stdout.strip() == "would move 1 task(s) from mia to alice"
    assert cli.json("tasks", "reassign-all", "mia", "alice", "--as", "boss")["reassigned"] == 1
    assert "from and to are both 'alice'" in cli.error("tasks", "reassign-all", "alice", "alice", "--as", "boss")
    done = cli.json("tasks", "complete", tid, "approve", "--as", "alice", "--payload", '{"comment": "ok"}',
                    "--idempotency-key", "k", "--app", APP)
    assert done["task"]["status"] == "COMPLETING" and not done["duplicate"]
    again = cli("tasks", "complete", tid, "approve", "--as", "alice", "--payload", '{"comment": "ok"}',
                "--idempotency-key", "k")
    assert again.exit_code == 0 and "repeated" in again.stdout
    shown = cli("tasks", "show", tid).stdout
    assert "COMPLETING" in shown and "approve by alice" in shown


def test_a_completion_repeated_under_its_key_after_the_task_was_given_back_completes_it(database_url: str) -> None:
    """After a dead-lettered completion's retry gave the task back, the same command with the same key said
    "repeated: nothing new recorded" and the task stayed OPEN."""
    cli = Cli(database_url)
    [iid] = _run(database_url, (expense, Expense(expense_id="c-2", employee="eve", amount=9)))
    [task] = cli.json("tasks", "list", "--user", "alice", "--group", "finance")["tasks"]
    complete = ("tasks", "complete", task["id"], "approve", "--as", "alice", "--group", "finance", "--payload",
                '{"comment": "ok"}', "--idempotency-key", "k")
    assert not cli.json(*complete)["duplicate"]

    async def dead_lettered_and_retried() -> None:
        async with open_engine(database_url, registry, max_claims=3) as engine:
            assert {claim.command.kind for claim in await die_alone(engine)} == {"TASK_COMPLETION"}
            await engine.run_until_idle()
            await engine.client.retry(iid)
            await engine.run_until_idle()

    asyncio.run(dead_lettered_and_retried())
    assert cli.json("tasks", "show", task["id"])["status"] == "OPEN"
    again = cli(*complete)
    assert again.exit_code == 0 and "repeated" not in again.stdout and "(command " in again.stdout
    assert cli.json("tasks", "show", task["id"])["status"] == "COMPLETING"


def test_saved_filters_and_follow_up_dates_on_the_command_line(database_url: str) -> None:
    cli = Cli(database_url)
    _run(database_url, (callback, {"customer": "ann", "call_at": None}),
         (callback, {"customer": "cy", "call_at": "2100-01-01T09:00:00+00:00"}))
    inbox = ("tasks", "list", "--user", "dee", "--group", "desk")
    assert len(cli.json(*inbox)["tasks"]) == 2
    [today] = cli.json(*inbox, "--hide-later-follow-ups")["tasks"]
    assert today["title"] == "Call ann back"
    assert len(cli.json(*inbox, "--follow-up-before", "2100-01-02")["tasks"]) == 2
    shown = cli("tasks", "show", cli.json(*inbox, "--text", "cy")["tasks"][0]["id"]).stdout
    assert "follow up" in shown and "2100-01-01" in shown

    saved = cli("tasks", "filters", "save", "today", "--as", "dee", "--hide-later-follow-ups", "--workflow",
                "callback")
    assert saved.stdout.strip() == "saved task filter today: mode inbox; workflow=callback, hide_later_follow_ups=True"
    assert [f["name"] for f in cli.json("tasks", "filters", "list", "--as", "dee")["filters"]] == ["today"]
    assert cli("tasks", "filters", "list", "--as", "eli").stdout.strip() == \
        "eli has no saved task filters in scope default"
    [used] = cli.json(*inbox, "--filter", "today")["tasks"]
    assert used["title"] == "Call ann back"
    assert cli.json("tasks", "count", "--user", "dee", "--group", "desk", "--filter", "today") == {"count": 1}
    assert "brings its own mode" in cli.error(*inbox, "--filter", "today", "--text", "x")
    assert "no saved task filter 'nope'" in cli.error(*inbox, "--filter", "nope")
    assert cli("tasks", "filters", "delete", "today", "--as", "dee").stdout.strip() == "deleted task filter today"
    assert "no saved task filter 'today'" in cli.error("tasks", "filters", "delete", "today", "--as", "dee")
    assert "who does this" in cli.error("tasks", "filters", "list")
    for command in ("list", "count"):  # the error names the option every task command takes
        message = cli.error("tasks", command, "--filter", "today")
        assert "whose inbox? pass --as USER or set STEPSTONE_ACTOR" in message, message


def test_every_task_command_names_its_user_with_as_and_still_takes_user(database_url: str) -> None:
    """`tasks list --user ann` but `tasks claim --as ann`, and `tasks filters` showed both: one user, two
    spellings. Every task command now shows `--as USER`; `--user` is still taken (hidden), so no script breaks."""
    cli = Cli(database_url)
    _run(database_url, (expense, Expense(expense_id="c-3", employee="eve", amount=9)))
    as_ann = cli.json("tasks", "list", "--as", "alice", "--group", "finance")
    assert [t["title"] for t in as_ann["tasks"]] == ["Approve expense c-3 of eve"]
    assert cli.json("tasks", "list", "--user", "alice", "--group", "finance") == as_ann
    assert cli.json("tasks", "count", "--as", "alice", "--group", "finance") == {"count": 1}
    assert cli.json("tasks", "count", "--mode", "all", "--as", "zed") == {"count": 0}  # --as narrows mode all
    assert "--as and --user name one user" in cli.error("tasks", "list", "--as", "alice", "--user", "bob")
    commands = [("list",), ("count",), ("claim",), ("unclaim",), ("resolve",), ("reassign",), ("delegate",),
                ("complete",), ("reassign-all",), ("filters", "save"), ("filters", "list"), ("filters", "delete")]
    for command in commands:
        helped = cli("tasks", *command, "--help").stdout
        assert "--as USER" in helped and "--user" not in helped, (command, helped)


def test_mode_all_lists_every_open_task_whoever_stepstone_actor_names(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STEPSTONE_ACTOR says who acts (`--as`). `tasks list --mode all`, "every open task", took it as
    `--user` too, which in mode all keeps that user's tasks alone: with it set, as for `claim` and
    `complete`, the list of every task showed none of another's. Only `--as` narrows mode all now."""
    cli = Cli(database_url)
    _run(database_url, (expense, Expense(expense_id="c-9", employee="eve", amount=9)))
    monkeypatch.setenv("STEPSTONE_ACTOR", "zed")
    assert cli.json("tasks", "count", "--mode", "all") == {"count": 1}
    assert len(cli.json("tasks", "list", "--mode", "all")["tasks"]) == 1
    assert cli.json("tasks", "count", "--mode", "all", "--as", "zed") == {"count": 0}  # --as narrows it


def test_messages_publish_says_what_happened(database_url: str) -> None:
    cli = Cli(database_url)
    assert "dropped" in cli("messages", "publish", "receipt_received", "k-1").stdout
    buffered = cli.json("messages", "publish", "receipt_received", "k-1", "--ttl", "60", "--payload", '{"n": 1}',
                        "--message-id", "m1")
    assert buffered["outcome"] == "buffered" and buffered["expires_at"]
    [iid] = _run(database_url, (receipt, Receipt(order_id="k-2")))
    delivered = cli("messages", "publish", "receipt_received", "k-2", "--payload", '{"n": 2}')
    assert delivered.stdout.strip() == f"message receipt_received delivered to {iid}"
    assert "not valid JSON" in cli.error("messages", "publish", "x", "k", "--payload", "{")


def test_messages_start_or_signal_from_the_command_line(database_url: str) -> None:
    """Signal-with-start had the Python and HTTP doors only: no command took it."""
    cli = Cli(database_url)
    first = cli.json("messages", "start-or-signal", "receipt", "bk-1", "skip", "--input", '{"order_id": "o-1"}',
                     "--payload", '{"n": 1}', "--dedup-key", "d-1", "--app", APP)
    assert first["started"] is True and first["scope"] == "default"
    again = cli.json("messages", "start-or-signal", "receipt", "bk-1", "skip", "--payload", '{"n": 1}',
                     "--dedup-key", "d-1", "--app", APP)
    # the same call again (its dedup key): the key's instance, no input needed, and it says its first attempt
    # started the instance
    assert (again["instance_id"], again["started"], again["command_id"]) == (
        first["instance_id"], True, first["command_id"]), "the same signal: the key's instance, no input needed"
    said = cli("messages", "start-or-signal", "receipt", "bk-1", "skip", "--app", APP).stdout.strip()
    assert said.startswith(f"signalled instance {first['instance_id']} (skip, command ")
    assert "input for workflow 'receipt' is invalid" in cli.error(
        "messages", "start-or-signal", "receipt", "bk-2", "skip", "--app", APP)
    assert "has no signal named 'nope'" in cli.error(
        "messages", "start-or-signal", "receipt", "bk-2", "nope", "--input", '{"order_id": "o-2"}', "--app", APP)
