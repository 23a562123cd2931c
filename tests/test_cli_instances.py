"""start / signal / cancel / retry / show / list through the CLI, against real PostgreSQL.

Commands run in-process with click's CliRunner; an in-process worker drives instances with
`run_until_idle`, so nothing waits on time.
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from click.testing import CliRunner, Result

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.cli import cli
from stepstone.cli.instance_args import decode_cursor, encode_cursor
from stepstone.errors import DatabaseUnavailable
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.store.postgres import PostgresStore
from tests import cli_apps

APP = "tests.cli_apps:registry"


class Cli:
    """The CLI bound to one test database."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __call__(self, *args: str, input: str | None = None) -> Result:  # noqa: A002 - CliRunner's name
        command, *rest = args
        return CliRunner().invoke(cli, [command, "--database-url", self.url, *rest], input=input,
                                  catch_exceptions=False)

    def json(self, *args: str) -> Any:
        result = self(*args, "-o", "json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)  # stdout holds the JSON document and nothing else

    def error(self, *args: str) -> str:
        result = self(*args)
        assert result.exit_code == 1, result.output
        assert result.stdout == ""
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("error: ")
        return lines[0]

    def drive(self, registry: Registry = cli_apps.registry) -> None:
        """Run every claimable command to the point where instances wait or end (and record `registry`)."""

        async def go() -> None:
            store = await PostgresStore.open(self.url)
            try:
                worker = Worker(store, registry, WorkerConfig(concurrency=2))
                await worker.register()
                await worker.run_until_idle()
            finally:
                await store.close()

        asyncio.run(go())

    def count(self, sql: str) -> int:
        async def go() -> int:
            conn = await asyncpg.connect(self.url)
            try:
                return int(await conn.fetchval(sql))
            finally:
                await conn.close()

        return asyncio.run(go())


@pytest.fixture
def run(database_url: str) -> Cli:
    return Cli(database_url)


@pytest.fixture
def flaky_fails() -> Iterator[None]:
    cli_apps.FLAKY["fail"] = True
    yield
    cli_apps.FLAKY["fail"] = True


def test_start_show_complete(run: Cli) -> None:
    started = run.json("start", "hello", "--input", '{"name": "ada"}', "--app", APP)
    instance_id = started["instance_id"]
    assert uuid.UUID(instance_id)
    shown = run.json("show", instance_id)
    assert shown["instance"]["status"] == "PENDING"
    assert [h["kind"] for h in shown["history"]] == ["INSTANCE_STARTED"]
    run.drive()
    shown = run.json("show", instance_id)
    assert shown["instance"]["status"] == "COMPLETED"
    assert shown["instance"]["state"] == {"name": "ada", "greeting": "hello ada"}
    assert [h["kind"] for h in shown["history"]] == ["INSTANCE_STARTED", "STEP_COMPLETED", "INSTANCE_COMPLETED"]
    text = run("show", instance_id).stdout
    assert "COMPLETED" in text and "hello v1" in text and '"greeting": "hello ada"' in text
    assert "STEP_COMPLETED" in text and "greet" in text


def test_start_prints_only_the_id_and_reads_input_files(run: Cli, tmp_path: Path) -> None:
    path = tmp_path / "input.json"
    path.write_text('{"name": "bob"}')
    result = run("start", "hello", "--input-file", str(path), "--app", APP)
    assert result.exit_code == 0, result.output
    instance_id = result.stdout.strip()
    assert uuid.UUID(instance_id)
    assert run.json("show", instance_id)["instance"]["state"]["name"] == "bob"
    from_stdin = run("start", "hello", "--input-file", "-", "--app", APP, input='{"name": "cy"}')
    assert run.json("show", from_stdin.stdout.strip())["instance"]["state"]["name"] == "cy"


def test_an_input_file_of_json_lines_starts_one_instance_per_line(run: Cli, tmp_path: Path) -> None:
    path = tmp_path / "inputs.jsonl"
    path.write_text("".join(f'{{"name": "n{n}"}}\n' for n in range(1_205)) + "\n")  # a blank line is skipped
    result = run("start", "hello", "--input-file", str(path), "--app", APP)
    assert result.exit_code == 0, result.output
    ids = result.stdout.split()
    assert len(ids) == 1_205 and len(set(ids)) == 1_205
    assert "started 1,205 of 1,205" in result.stderr  # progress, one line per batch of a thousand
    assert run.json("show", ids[-1])["instance"]["state"]["name"] == "n1204"  # in line order
    assert run.count("SELECT count(*) FROM stepstone.instances") == 1_205
    as_json = run("start", "hello", "--input-file", "-", "--app", APP, "-o", "json",
                  input='{"name": "a"}\n{"name": "b"}\n')
    assert len(json.loads(as_json.stdout)["instance_ids"]) == 2


@pytest.mark.parametrize(
    ("text", "extra", "message"),
    [
        ('{"name": "a"}\n{"name":\n', (), "line 2 is not valid JSON"),
        ('{"name": "a"}\n\n{"nom": 1}\n', (), "inputs.jsonl line 3: input for workflow 'hello' is invalid"),
        ('{"name": "a"}\n{"name": "b"}\n', ("--business-key", "k"), "an --input-file of 2 lines starts 2"),
        ('{\n  "name":\n', (), "inputs.jsonl is not valid JSON"),
    ],
)
def test_bad_json_lines_start_nothing(
    run: Cli, tmp_path: Path, text: str, extra: tuple[str, ...], message: str
) -> None:
    path = tmp_path / "inputs.jsonl"
    path.write_text(text)
    assert message in run.error("start", "hello", "--input-file", str(path), "--app", APP, *extra)
    assert run.count("SELECT count(*) FROM stepstone.instances") == 0


def test_an_input_file_that_is_not_utf8_is_one_line_and_starts_nothing(run: Cli, tmp_path: Path) -> None:
    """A file in another encoding (a spreadsheet's Latin-1 export) ended `start` with a traceback."""
    path = tmp_path / "inputs.jsonl"
    path.write_bytes('{"name": "a"}\n{"name": "Jos\u00e9"}\n'.encode("latin-1"))
    assert run.error("start", "hello", "--input-file", str(path), "--app", APP) == (
        f"error: --input-file {path} is not UTF-8 text: byte 0xe9 at offset 27 (save it as UTF-8)")
    assert run.count("SELECT count(*) FROM stepstone.instances") == 0


def test_a_file_whose_starts_fail_part_way_says_which_lines_started(
    run: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An --input-file whose starts failed part-way (the database went away, Ctrl-C) said only why: the
    batches committed before stayed started with no word of which lines they were, so the file could
    be neither resumed nor run again without starting them twice. Their ids are printed now, in line
    order, and the error names the lines started."""
    real = PostgresStore.start_many

    async def failing(self: PostgresStore, new: Any) -> list[tuple[str, bool]]:
        if "n1500" in str(new.states):  # the second batch, lines 1,001 to 2,000, fails; the others start
            raise DatabaseUnavailable("cannot reach PostgreSQL at db:5432: connection lost")
        return await real(self, new)

    monkeypatch.setattr(PostgresStore, "start_many", failing)
    path = tmp_path / "inputs.jsonl"
    path.write_text("".join(f'{{"name": "n{n}"}}\n' for n in range(2_500)))
    result = run("start", "hello", "--input-file", str(path), "--app", APP)
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines()[-1] == (
        "error: cannot reach PostgreSQL at db:5432: connection lost: 1,500 of 2,500 started, lines 1-1000 "
        "and 2001-2500 (their ids are printed, in line order); the other lines did not, unless their batch was "
        "in flight as it stopped")
    ids = result.stdout.split()
    assert len(ids) == 1_500
    monkeypatch.setattr(PostgresStore, "start_many", real)
    assert [run.json("show", ids[n])["instance"]["state"]["name"] for n in (0, 999, 1_000, 1_499)] == [
        "n0", "n999", "n2000", "n2499"]
    assert run.count("SELECT count(*) FROM stepstone.instances") == 1_500
    monkeypatch.setattr(PostgresStore, "start_many", failing)
    as_json = run("start", "hello", "--input-file", str(path), "--app", APP, "-o", "json")
    assert as_json.exit_code == 1
    assert json.loads(as_json.stdout)["lines_started"] == [[1, 1_000], [2_001, 2_500]]
    assert len(json.loads(as_json.stdout)["instance_ids"]) == 1_500


def test_start_keys(run: Cli) -> None:
    first = run.json("start", "hello", "--input", '{"name": "a"}', "--idempotency-key", "k1", "--app", APP)
    again = run.json("start", "hello", "--input", '{"name": "a"}', "--idempotency-key", "k1", "--app", APP)
    assert first == again
    assert "different input" in run.error("start", "hello", "--input", '{"name": "b"}', "--idempotency-key", "k1",
                                          "--app", APP)
    keyed = run.json("start", "hello", "--input", '{"name": "a"}', "--business-key", "order-7", "--app", APP)
    assert "already used by instance " + keyed["instance_id"] in run.error(
        "start", "hello", "--input", '{"name": "a"}', "--business-key", "order-7", "--app", APP)
    listed = run.json("list", "--business-key", "order-7")
    assert [r["id"] for r in listed["instances"]] == [keyed["instance_id"]]


def test_signal_moves_a_waiting_instance(run: Cli) -> None:
    instance_id = run.json("start", "approval", "--app", APP)["instance_id"]
    run.drive()
    shown = run.json("show", instance_id)
    assert shown["instance"]["status"] == "WAITING"
    assert shown["waiting_for"] == "signal approve"
    assert "waiting for  signal approve" in run("show", instance_id).stdout
    sent = run.json("signal", instance_id, "approve", "--payload", '{"by": "eve"}', "--dedup-key", "d1")
    assert sent["instance_id"] == instance_id and sent["signal"] == "approve"
    assert run.json("signal", instance_id, "approve", "--payload", '{"by": "eve"}', "--dedup-key", "d1") == sent
    run.drive()
    shown = run.json("show", instance_id)
    assert shown["instance"]["status"] == "COMPLETED"
    assert shown["instance"]["state"] == {"approved_by": {"by": "eve"}}
    assert "takes no more signals" in run.error("signal", instance_id, "approve")


def test_cancel(run: Cli) -> None:
    instance_id = run.json("start", "approval", "--app", APP)["instance_id"]
    run.drive()
    assert run.json("cancel", instance_id, "--reason", "customer asked") == {
        "instance_id": instance_id, "status": "CANCELLED", "outcome": "cancelled"}
    again = run.json("cancel", instance_id)  # repeating is harmless
    assert (again["status"], again["outcome"]) == ("CANCELLED", "unchanged")
    history = run.json("show", instance_id)["history"]
    assert history[-1]["kind"] == "INSTANCE_CANCELLED"
    assert run.json("show", instance_id)["instance"]["status"] == "CANCELLED"


def test_cancel_with_compensation_of_a_saga_that_has_not_ended_says_why_nothing_changed(run: Cli) -> None:
    """`cancel --compensate` leaves a COMPENSATION_FAILED saga as it is; it said 'already ended, nothing to
    cancel' of an instance that had not ended and waits for an operator."""
    instance_id = run.json("start", "refund_saga", "--app", APP)["instance_id"]
    run.drive()
    assert run.json("show", instance_id)["instance"]["status"] == "COMPENSATION_FAILED"
    result = run("cancel", instance_id, "--compensate")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == (
        f"{instance_id} COMPENSATION_FAILED: its compensation stopped; nothing changed "
        "(`stepstone retry` resumes it, `stepstone cancel` without --compensate gives up)")
    assert run.json("cancel", instance_id, "--compensate")["outcome"] == "unchanged"
    assert run("cancel", instance_id).stdout.strip() == f"{instance_id} CANCELLED"
    assert run("cancel", instance_id).stdout.strip() == f"{instance_id} CANCELLED: already ended, nothing to cancel"


def test_retry_resumes_a_stopped_compensation_as_its_help_says(run: Cli) -> None:
    """`stepstone retry --help` (and the API's summary) said only "Run the failed step of a FAILED
    instance again", though retry is the way to resume a saga stopped at COMPENSATION_FAILED."""
    help_text = " ".join(CliRunner().invoke(cli, ["retry", "--help"]).output.split())
    assert "or resume the compensation of a COMPENSATION_FAILED one where it stopped" in help_text
    instance_id = run.json("start", "refund_saga", "--app", APP)["instance_id"]
    run.drive()
    cli_apps.REFUNDS_DOWN["down"] = False
    try:
        assert run.json("retry", instance_id)["status"] == "COMPENSATING"
        run.drive()
    finally:
        cli_apps.REFUNDS_DOWN["down"] = True
    shown = run.json("show", instance_id)["instance"]
    assert (shown["status"], shown["state"]) == ("COMPENSATED", {"refunded": True})


@pytest.mark.usefixtures("flaky_fails")
def test_retry_a_failed_instance(run: Cli) -> None:
    instance_id = run.json("start", "flaky", "--app", APP)["instance_id"]
    assert "only a FAILED or COMPENSATION_FAILED instance can be retried" in run.error("retry", instance_id)
    run.drive()
    shown = run.json("show", instance_id)
    assert shown["instance"]["status"] == "FAILED"
    assert shown["instance"]["error"]["type"] == "RuntimeError"
    assert "RuntimeError: the service said no" in run("show", instance_id).stdout
    cli_apps.FLAKY["fail"] = False
    retried = run.json("retry", instance_id)
    assert retried["instance_id"] == instance_id and retried["status"] != "FAILED"
    run.drive()
    shown = run.json("show", instance_id)
    assert shown["instance"]["status"] == "COMPLETED"
    assert shown["instance"]["state"] == {"ok": True}


@pytest.mark.usefixtures("flaky_fails")
def test_show_prints_where_the_failed_step_raised(run: Cli) -> None:
    instance_id = run.json("start", "flaky", "--app", APP)["instance_id"]
    run.drive()
    [frame] = run.json("show", instance_id)["instance"]["error"]["frames"]
    raising = 'raise RuntimeError("the service said no")'
    line = next(n for n, text in enumerate(Path(cli_apps.__file__).read_text().splitlines(), 1) if raising in text)
    assert frame == {"file": cli_apps.__file__, "line": line, "function": "attempt", "source": raising}
    text = run("show", instance_id).stdout
    assert (f'traceback\nTraceback (most recent call last):\n  File "{cli_apps.__file__}", line {line}, in attempt\n'
            f"    {raising}\nRuntimeError: the service said no\n") in text
    assert '"frames"' not in text  # the history's rows leave the frames to the traceback above
    run.count("UPDATE stepstone.instances SET error = error - 'frames' RETURNING 1")  # as an earlier release wrote it
    text = run("show", instance_id).stdout
    assert "RuntimeError: the service said no" in text and "Traceback" not in text


def test_list_filters_and_pages_newest_first(run: Cli) -> None:
    ids = [run.json("start", "hello", "--input", json.dumps({"name": str(i)}), "--app", APP)["instance_id"]
           for i in range(5)]
    waiting = run.json("start", "approval", "--app", APP)["instance_id"]
    run.drive()
    assert [r["id"] for r in run.json("list", "--status", "waiting")["instances"]] == [waiting]
    assert [r["id"] for r in run.json("list", "--workflow", "hello")["instances"]] == ids[::-1]
    seen: list[str] = []
    cursor: str | None = None
    while True:
        page = run.json("list", "--workflow", "hello", "--limit", "2", *(["--after", cursor] if cursor else []))
        seen += [r["id"] for r in page["instances"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ids[::-1]
    text = run("list", "--limit", "2").stdout
    rows = [line.strip() for line in text.splitlines() if line.strip()[:36].count("-") == 4]  # an id first
    assert rows[0].startswith(waiting)
    assert "next page: --after " in text.splitlines()[-1]
    assert "no instances" in run("list", "--status", "failed").stdout


def test_cursor_round_trip() -> None:
    from datetime import UTC, datetime  # noqa: PLC0415

    at = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    instance_id = str(uuid.uuid4())
    assert decode_cursor(encode_cursor(at, instance_id)) == (at, instance_id)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("start", "hello", "--input", "{not json", "--app", APP), "--input is not valid JSON"),
        (("start", "hello", "--input", "[1, 2]", "--app", APP), "valid dictionary"),
        (("start", "hello", "--input", '{"nom": 1}', "--app", APP), "input for workflow 'hello' is invalid"),
        (("start", "nope", "--input", "{}", "--app", APP), "no workflow definition 'nope'"),
        (("start", "hello", "--input", "{}", "--input-file", "x", "--app", APP), "not both"),
        (("start", "hello", "--input-file", "/no/such/file.json", "--app", APP), "cannot read --input-file"),
        (("start", "hello", "--app", "tests.cli_apps:nothing"), "has no attribute 'nothing'"),
        (("show", "not-a-uuid"), "'not-a-uuid' is not an instance id"),
        (("signal", "12345", "approve"), "'12345' is not an instance id"),
        (("cancel", "xyz"), "'xyz' is not an instance id"),
        (("retry", "xyz"), "'xyz' is not an instance id"),
        (("show", str(uuid.UUID(int=1))), f"no instance {uuid.UUID(int=1)}"),
        (("signal", str(uuid.UUID(int=1)), "approve"), f"no instance {uuid.UUID(int=1)}"),
        (("cancel", str(uuid.UUID(int=1))), f"no instance {uuid.UUID(int=1)}"),
        (("retry", str(uuid.UUID(int=1))), f"no instance {uuid.UUID(int=1)}"),
        (("signal", str(uuid.UUID(int=1)), "approve", "--payload", "{oops"), "--payload is not valid JSON"),
        (("list", "--after", "garbage"), "is not a cursor printed by `stepstone list`"),
        (("list", "--after", base64.urlsafe_b64encode(b"[" * 5000).decode()), "is not a cursor printed by"),
        (("start", "hello", "--input", "[" * 100_000, "--app", APP), "--input is not valid JSON: nested too deeply"),
    ],
)
def test_bad_input_is_one_line_and_stores_nothing(run: Cli, args: tuple[str, ...], message: str) -> None:
    assert message in run.error(*args)
    assert run.count("SELECT count(*) FROM stepstone.instances") == 0
    assert run.count("SELECT count(*) FROM stepstone.commands") == 0


def test_unknown_signal_is_refused_and_stores_nothing(run: Cli) -> None:
    instance_id = run.json("start", "approval", "--app", APP)["instance_id"]
    commands = run.count("SELECT count(*) FROM stepstone.commands")
    assert "has no signal named 'nope'" in run.error("signal", instance_id, "nope")
    assert run.count("SELECT count(*) FROM stepstone.commands") == commands


def test_start_needs_an_app(run: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPSTONE_APP", raising=False)
    assert "pass --app module:attribute or set STEPSTONE_APP" in run.error("start", "hello")
    monkeypatch.setenv("STEPSTONE_APP", APP)
    assert uuid.UUID(run.json("start", "hello", "--input", '{"name": "env"}')["instance_id"])


def test_a_start_of_a_version_the_app_lacks_names_the_app(run: Cli) -> None:
    """The database selects hello v2 (recorded first), which --app does not hold: the refusal named "this
    client's registry", which is nothing a user of the CLI gave."""
    newer: Workflow[cli_apps.Greeting] = Workflow("hello", version=2, state=cli_apps.Greeting)

    @newer.step(next=None)
    def greet(ctx: StepContext, state: cli_apps.Greeting) -> None: ...

    run.drive(Registry(newer))
    assert run.error("start", "hello", "--input", '{"name": "ada"}', "--app", APP) == (
        "error: workflow definition 'hello' v2 is the version scope default selects, and --app lacks it "
        "(or holds another structure under that version)")


def test_unmigrated_database_is_a_one_line_error(empty_database_url: str) -> None:
    line = Cli(empty_database_url).error("list")
    assert "is not set up: run `stepstone db migrate` first" in line


def test_deadline_takes_the_duration_forms_of_the_other_options(run: Cli) -> None:
    """`--deadline` took seconds only (`2h` was a usage error), where --older-than, --retention-every and
    the retention windows take 90s, 15m, 2h, 30d, 1w."""
    from datetime import datetime  # noqa: PLC0415

    for given in ("2h", "7200", "120m"):
        instance_id = run.json("start", "approval", "--app", APP, "--deadline", given)["instance_id"]
        shown = run.json("show", instance_id)["instance"]
        due = datetime.fromisoformat(shown["next_timer_at"]) - datetime.fromisoformat(shown["created_at"])
        assert abs(due.total_seconds() - 7200) < 60, (given, due)
    for bad in ("2x", "-5", "99999999w"):
        result = run("start", "approval", "--app", APP, "--deadline", bad)
        assert result.exit_code == 2 and "--deadline" in result.stderr, (bad, result.output)


def test_show_lists_a_sagas_compensations(run: Cli) -> None:
    """Neither the CLI nor the API listed a saga's compensations (only `client.compensations` did): an
    operator could not see which step's undo stopped, or how often it was tried."""
    instance_id = run.json("start", "refund_saga", "--app", APP)["instance_id"]
    run.drive()
    shown = run.json("show", instance_id)
    assert shown["instance"]["status"] == "COMPENSATION_FAILED"
    [pay] = shown["compensations"]
    assert (pay["step"], pay["status"], pay["attempts"], pay["position"]) == ("pay", "FAILED", 1, "")
    assert "refund service unavailable" in json.dumps(pay["last_error"]) and "recorded" not in pay
    text = run("show", instance_id).stdout
    section = text.split("\ncompensations\n", 1)[1].split("\n\nhistory\n", 1)[0].splitlines()
    assert section[0].split() == ["step", "position", "visit", "status", "attempts", "completed", "compensated",
                                  "last", "error"]
    assert section[1].split()[:5] == ["pay", "(root)", "1", "FAILED", "1"] and "ConnectionError" in section[1]
    hello = run.json("start", "hello", "--app", APP, "--input", '{"name": "ada"}')["instance_id"]
    assert run.json("show", hello)["compensations"] == [] and "compensations" not in run("show", hello).stdout
