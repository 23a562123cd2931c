"""`stepstone schedules` and `stepstone limits` through the CLI, in-process, against real PostgreSQL."""

from __future__ import annotations

import pytest
from click.testing import CliRunner, Result

from stepstone.cli import cli
from tests.test_cli_instances import APP, Cli


class GroupCli(Cli):
    """The database URL as the root group's flag: `stepstone --database-url URL schedules list`."""

    def __call__(self, *args: str, input: str | None = None) -> Result:  # noqa: A002 - CliRunner's name
        return CliRunner().invoke(cli, ["--database-url", self.url, *args], input=input, catch_exceptions=False)


@pytest.fixture
def run(database_url: str) -> Cli:
    return GroupCli(database_url)


def test_schedules_create_list_pause_resume_trigger_delete(run: Cli) -> None:
    made = run.json("schedules", "create", "nightly", "hello", "--cron", "0 2 * * *", "--timezone",
                    "Europe/Paris", "--input", '{"name": "ada"}', "--app", APP)
    assert made["workflow"] == "hello" and made["spec"]["timezone"] == "Europe/Paris"
    listed = run("schedules", "list")
    assert listed.exit_code == 0
    assert "nightly" in listed.stdout and "cron 0 2 * * * (Europe/Paris)" in listed.stdout
    assert run("schedules", "pause", "nightly").stdout.strip() == "schedule nightly paused"
    assert run.json("schedules", "list")[0]["paused"] is True
    assert run("schedules", "resume", "nightly").stdout.startswith("schedule nightly resumed; next tick ")
    iid = run.json("schedules", "trigger", "nightly", "--app", APP)["instance_id"]
    run.drive()
    assert run.json("show", iid)["instance"]["state"] == {"name": "ada", "greeting": "hello ada"}
    assert run("schedules", "delete", "nightly").stdout.strip() == "schedule nightly deleted"
    assert run("schedules", "list").stdout.strip() == "no schedules"


def test_schedule_errors_are_one_line(run: Cli) -> None:
    assert run.error("schedules", "pause", "nope") == "error: no schedule named 'nope'"
    line = run.error("schedules", "create", "s", "hello", "--cron", "0 25 * * *")
    assert line == "error: schedule 's': cron expression '0 25 * * *': hour field '25' is outside 0-23"
    assert run.error("schedules", "create", "s", "hello") == "error: give --cron EXPR or --every DURATION (one of them)"
    never = run.error("schedules", "create", "s", "hello", "--cron", "0 0 31 2 *")  # was a traceback
    assert never == "error: schedule 's': cron expression '0 0 31 2 *' never fires"
    # A RecursionError at any recursion limit an earlier test in the process may have left raised
    deep = run.error("schedules", "create", "s", "hello", "--every", "60", "--input", "[" * 100_000)
    assert deep == "error: --input is not valid JSON: nested too deeply"


def test_limits_set_list_remove(run: Cli) -> None:
    assert run("limits", "set", "hello", "--max-running", "2", "--key", "name").stdout.strip() == "limit set on hello"
    [limit] = run.json("limits", "list")
    assert (limit["workflow"], limit["key"], limit["max_running"], limit["waiting"]) == ("hello", "name", 2, 0)
    assert "released" in run("limits", "remove", "hello").stdout
    assert run("limits", "list").stdout.strip() == "no limits"
    assert run.error("limits", "set", "hello") == "error: give --max-running N, --min-interval DURATION or both"


def test_pause_resume_delete_and_the_limits_answer_in_json(run: Cli) -> None:
    """`-o json` on every command of both groups, as on the listings: one JSON document on stdout."""
    run.json("schedules", "create", "hourly", "hello", "--every", "3600", "--input", '{"name": "ada"}', "--app", APP)
    assert run.json("schedules", "pause", "hourly") == {"name": "hourly", "paused": True}
    resumed = run.json("schedules", "resume", "hourly")
    assert (resumed["name"], resumed["paused"], resumed["next_fire_at"][10]) == ("hourly", False, "T")
    assert run.json("schedules", "delete", "hourly") == {"name": "hourly", "deleted": True}
    assert run.json("limits", "set", "hello", "--max-running", "2") == {"scope": "default", "workflow": "hello",
                                                                        "admitted": 0}
    assert run.json("limits", "remove", "hello") == {"scope": "default", "workflow": "hello", "released": 0}


def test_every_and_min_interval_take_durations_as_the_other_options_do(run: Cli) -> None:
    """`schedules create --every 1h` was "'1h' is not a valid float" (exit 2), though --deadline, --older-than
    and the worker's --retention-every take 1h; so was `limits set --min-interval 2m`."""
    made = run.json("schedules", "create", "hourly", "hello", "--every", "1h", "--input", '{"name": "ada"}',
                    "--app", APP)
    assert made["spec"]["every_seconds"] == 3600
    run("limits", "set", "hello", "--min-interval", "2m")
    assert [limit["min_interval"] for limit in run.json("limits", "list")] == [120]
    assert "'1x' is not a duration: give seconds" in run("schedules", "create", "s", "hello", "--every", "1x").stderr


def test_removing_a_limit_that_is_not_there_is_an_error(run: Cli) -> None:
    """`limits remove hellp` (a typo) said `limit removed from hellp; 0 waiting instance(s) released`, exit 0."""
    run("limits", "set", "hello", "--max-running", "2")
    assert run.error("limits", "remove", "hellp") == (
        "error: no flow limit on 'hellp' (`stepstone limits list` shows them)")
    assert [limit["workflow"] for limit in run.json("limits", "list")] == ["hello"]


def test_a_schedule_or_limit_of_a_workflow_registered_nowhere_is_kept_with_a_warning(run: Cli) -> None:
    """`schedules create s nosuch` (a typo) was taken in silence; then every tick logged an error. It is still
    taken (the code may be deployed later), with a warning on stderr; a workflow --app or the database has
    none."""
    made = run("schedules", "create", "s", "helo", "--every", "60", "-o", "json")
    assert made.exit_code == 0 and '"workflow": "helo"' in made.stdout  # stdout: the JSON alone
    assert made.stderr.strip() == (
        "warning: no workflow 'helo' is registered in the database: the schedule is kept, and its ticks start "
        "nothing (a worker logs an error for each) until a version of it is deployed; "
        "`stepstone definitions list` shows the registered workflows")
    with_app = run("schedules", "create", "s", "helo", "--every", "60", "--app", APP)
    assert with_app.exit_code == 0 and with_app.stderr.startswith(
        "warning: no workflow 'helo' is registered in the database or in --app: the schedule is kept")
    limited = run("limits", "set", "helo", "--max-running", "2")
    assert limited.exit_code == 0 and limited.stdout.strip() == "limit set on helo"
    assert limited.stderr.strip() == (
        "warning: no workflow 'helo' is registered in the database: the limit is kept, and holds its instances "
        "once a version of it is deployed; `stepstone definitions list` shows the registered workflows")
    known = run("schedules", "create", "t", "hello", "--every", "60", "--input", '{"name": "ada"}', "--app", APP)
    assert known.exit_code == 0 and known.stderr == "", known.stderr  # --app has it
    run.drive()  # records hello in the database
    assert run("limits", "set", "hello", "--max-running", "2").stderr == ""
    assert run("schedules", "create", "u", "hello", "--every", "60", "--input", '{"name": "ada"}').stderr == ""
