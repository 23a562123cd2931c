"""The command line: one-line errors, exit codes, migrate/status/sql/doctor against real PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import pytest
from click.testing import CliRunner, Result

from stepstone.cli import cli
from stepstone.store.migrate import shipped_migrations
from tests._pg import PgServer


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def one_line_error(result: Result) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.mark.parametrize("schema", ["a$$b", "o'brien", 'x";drop'])
@pytest.mark.parametrize("where", ["root", "command"])
def test_invalid_schema_is_refused_and_nothing_created(empty_database_url: str, schema: str, where: str) -> None:
    opts = ["--database-url", empty_database_url, "--schema", schema]
    args = [*opts, "db", "migrate"] if where == "root" else ["db", "migrate", *opts]
    line = one_line_error(run(*args))
    assert "invalid schema name" in line

    async def schemas() -> list[str]:
        conn = await asyncpg.connect(empty_database_url)
        try:
            rows = await conn.fetch("SELECT nspname FROM pg_namespace WHERE nspname NOT LIKE 'pg_%'")
            return sorted(r["nspname"] for r in rows)
        finally:
            await conn.close()

    import asyncio  # noqa: PLC0415

    assert asyncio.run(schemas()) == ["information_schema", "public"]


def test_unreachable_names_host_port_and_hides_password() -> None:
    line = one_line_error(run("--database-url", "postgresql://bob:s3cretpw@127.0.0.1:1/db", "db", "migrate"))
    assert "127.0.0.1:1" in line
    assert "s3cretpw" not in line


@pytest.mark.parametrize(
    "url", ["postgresql://bob:s3cretpw@localhost:notaport/db", "mysql://bob:s3cretpw@h/db", "not a url"]
)
def test_malformed_url(url: str) -> None:
    line = one_line_error(run("--database-url", url, "db", "status"))
    assert "malformed database URL" in line
    assert "s3cretpw" not in line


def test_unknown_host() -> None:
    line = one_line_error(run("--database-url", "postgresql://u:pw1234@no-such-host.invalid:5433/db", "doctor"))
    assert "no-such-host.invalid:5433" in line and "pw1234" not in line


@pytest.fixture
def unprivileged_url(pg_server: PgServer, empty_database_url: str) -> Iterator[str]:
    role = f"nopriv_{uuid.uuid4().hex[:8]}"
    pg_server.execute(f"CREATE ROLE {role} LOGIN")
    try:
        yield pg_server.url_for(urlsplit(empty_database_url).path.lstrip("/"), user=role)
    finally:
        pg_server.execute(f"DROP ROLE IF EXISTS {role}")


def test_insufficient_privilege(unprivileged_url: str) -> None:
    line = one_line_error(run("--database-url", unprivileged_url, "db", "migrate"))
    assert "insufficient privilege" in line


def test_migrate_status_and_rerun(empty_database_url: str) -> None:
    status = run("--database-url", empty_database_url, "db", "status")
    assert status.exit_code == 1 and "pending" in status.stdout
    first = run("--database-url", empty_database_url, "db", "migrate")
    assert first.exit_code == 0 and "applied 0001_" in first.stdout
    again = run("--database-url", empty_database_url, "db", "migrate")
    assert again.exit_code == 0 and "up to date" in again.stdout
    status = run("--database-url", empty_database_url, "db", "status", "-o", "json")
    assert status.exit_code == 0
    data = json.loads(status.stdout)
    assert data["pending"] == [] and data["applied"][0]["version"] == 1


def test_newer_history_is_run_on_and_one_lacking_a_shipped_version_refused(database_url: str,
                                                                             pg_server: PgServer) -> None:
    async def execute(statement: str) -> None:
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    import asyncio  # noqa: PLC0415

    asyncio.run(execute("INSERT INTO stepstone.schema_migrations VALUES (9999, 'future', now(), 'x')"))
    # A newer release's schema: migrations only add, so this release applies nothing and runs on it
    # (tests/test_schema_newer_release.py has the rest).
    migrated = run("--database-url", database_url, "db", "migrate")
    assert migrated.exit_code == 0 and "nothing to apply" in migrated.stdout, migrated.output
    status = run("--database-url", database_url, "db", "status")  # each version once (9999 was listed twice)
    [line] = [line for line in status.stdout.splitlines() if "9999" in line]
    assert status.exit_code == 1 and line.startswith("9999_future  applied ")
    assert line.endswith(", unknown to this stepstone"), status.stdout
    assert run("--database-url", database_url, "doctor").exit_code == 0
    asyncio.run(execute("DELETE FROM stepstone.schema_migrations WHERE version = 1"))  # no release's history
    assert "9999" in one_line_error(run("--database-url", database_url, "db", "migrate"))
    assert "9999" in one_line_error(run("--database-url", database_url, "doctor"))


def test_doctor_ok_and_json(database_url: str) -> None:
    result = run("--database-url", database_url, "doctor")
    assert result.exit_code == 0, result.output
    assert "--database-url" in result.stdout and "status: ok" in result.stdout
    data = json.loads(run("--database-url", database_url, "doctor", "-o", "json").stdout)
    assert data["database"]["reachable"] is True
    assert data["database"]["mode"] == "configured"
    assert data["schema"]["pending"] == []
    assert data["config"]["schema"] == {"value": "stepstone", "source": "default"}


def test_doctor_reports_pending(empty_database_url: str) -> None:
    result = run("--database-url", empty_database_url, "doctor")
    assert result.exit_code == 1 and "pending" in result.stderr


def test_db_sql_is_offline_and_rendered() -> None:
    result = run("--schema", "wf", "db", "sql")
    assert result.exit_code == 0
    assert '"wf".schema_migrations' in result.stdout and "{{schema}}" not in result.stdout
    latest = max(m.version for m in shipped_migrations())
    for since in (latest + 1, -1):  # printed the bootstrap and nothing, exit 0
        refused = run("db", "sql", "--since", str(since))
        assert refused.exit_code == 2 and "--since" in refused.stderr, refused.output


def test_usage_error_exits_2() -> None:
    assert run("db", "nosuch").exit_code == 2
    assert run("doctor", "-o", "xml").exit_code == 2


@pytest.mark.parametrize("args", [
    ("find", "--version", "99999999999"), ("definitions", "activate", "wf", "2147483648"),
    ("limits", "set", "wf", "--max-running", "99999999999999"), ("outbox", "requeue", "99999999999999999999"),
    ("tasks", "list", "--priority-at-least", "-99999999999"), ("bench", "--concurrency", "0"),
    ("history", "00000000-0000-0000-0000-000000000001", "--after", "99999999999999999999"),  # was "no entries"
])
def test_an_integer_no_column_holds_is_a_usage_error(database_url: str, args: tuple[str, ...]) -> None:
    """Each once reached the driver, which refused it with a traceback ("value out of int32 range")."""
    result = run("--database-url", database_url, *args)
    assert result.exit_code == 2 and "is not in the range" in result.stderr, result.output


@pytest.mark.parametrize("args", [
    ("definitions", "stranded", "--within-minutes", "nan"),
    ("messages", "publish", "paid", "k-1", "--ttl", "nan"),
    ("worker", "--app", "tests.cli_apps:registry", "--lease-seconds", "nan"),
    ("worker", "--app", "tests.cli_apps:registry", "--poll-interval", "inf"),
])
def test_a_number_that_is_none_is_a_usage_error(database_url: str, args: tuple[str, ...]) -> None:
    """click's FloatRange lets NaN through: `definitions stranded --within-minutes nan` reached the server
    ('interval out of range', a traceback)."""
    result = run("--database-url", database_url, *args)
    assert result.exit_code == 2, result.output
    assert any(words in result.stderr for words in ("is not a number", "is not in the range", "is not a duration"))


def test_console_script_has_no_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from stepstone.cli import main; main()", "--schema", "a$$b", "db", "sql"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "invalid schema name" in proc.stderr


@pytest.fixture
def no_embedded_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Run in an empty directory with starting the embedded server a test failure, not a side effect."""
    from stepstone.store import embedded  # noqa: PLC0415

    def refuse(**_: object) -> None:
        raise AssertionError("the embedded server was started")

    monkeypatch.setattr(embedded, "ensure_server", refuse)
    monkeypatch.chdir(tmp_path)
    for name in ("STEPSTONE_DATABASE_URL", "DATABASE_URL", "STEPSTONE_SCHEMA"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


@pytest.mark.parametrize("where", ["root", "command"])
def test_empty_database_url_is_refused(no_embedded_server: Path, where: str) -> None:
    args = ["--database-url", "", "doctor"] if where == "root" else ["doctor", "--database-url", ""]
    assert "--database-url is empty" in one_line_error(run(*args))


def test_unknown_pyproject_key_is_one_error_line(no_embedded_server: Path) -> None:
    (no_embedded_server / "pyproject.toml").write_text(
        "[tool.stepstone]\ndatabse_url = 'postgresql://postgres@127.0.0.1:1/x'\n")
    line = one_line_error(run("doctor"))
    assert "unknown key 'databse_url'" in line and "database_url" in line.split("unknown key")[1]


def test_json_output_writes_every_time_as_iso_8601(capsys: pytest.CaptureFixture[str]) -> None:
    """`-o json` went through json.dumps(default=str): a datetime the command had not converted came out
    as "2026-12-06 07:02:38.050301+00:00" (outbox list, tokens), others as ISO 8601."""
    from datetime import UTC, date, datetime, timedelta  # noqa: PLC0415

    from stepstone.cli.common import emit  # noqa: PLC0415

    at = datetime(2026, 12, 6, 7, 2, 38, 50301, tzinfo=UTC)
    emit({"at": at, "rows": [{"on": date(2026, 12, 6)}], "window": timedelta(hours=2), "id": uuid.UUID(int=1)},
         "json", lambda: "")
    assert json.loads(capsys.readouterr().out) == {
        "at": "2026-12-06T07:02:38.050301+00:00", "rows": [{"on": "2026-12-06"}], "window": 7200.0,
        "id": "00000000-0000-0000-0000-000000000001"}


def test_migrate_and_status_take_the_database_an_app_names(empty_database_url: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`db migrate --app M:A` migrates the database and schema the app names with `stepstone_database()`,
    as every other command given that --app works on; `db migrate` took no --app (exit 2, "No such
    option"), so an app's database had to be named again by hand."""
    (tmp_path / "app_with_db.py").write_text(
        "from stepstone.authoring.workflow import Registry\n"
        "from stepstone.config import Settings\n"
        "registry = Registry()\n"
        "def stepstone_database():\n"
        f"    return Settings(database_url={empty_database_url!r}, schema='appflows',\n"
        "                    sources={'database_url': 'the test app'})\n")
    monkeypatch.chdir(tmp_path)  # no pyproject.toml here: nothing configured but what the app names
    for name in ("STEPSTONE_DATABASE_URL", "DATABASE_URL", "STEPSTONE_SCHEMA", "STEPSTONE_APP"):
        monkeypatch.delenv(name, raising=False)
    status = run("db", "status", "--app", "app_with_db:registry")
    assert status.exit_code == 1 and "pending" in status.stdout, status.output
    migrated = run("db", "migrate", "--app", "app_with_db:registry")
    assert migrated.exit_code == 0 and "applied 0001_" in migrated.stdout, migrated.output
    assert run("--app", "app_with_db:registry", "db", "status").exit_code == 0

    async def versions() -> int:
        conn = await asyncpg.connect(empty_database_url)
        try:
            return int(await conn.fetchval("SELECT count(*) FROM appflows.schema_migrations"))
        finally:
            await conn.close()

    import asyncio  # noqa: PLC0415

    assert asyncio.run(versions()) == len(shipped_migrations())
    assert not (tmp_path / ".stepstone").exists()  # no embedded server was started instead
    refused = one_line_error(run("db", "migrate", "--app", "app_with_db:registry", "--schema", "other"))
    assert "works in the schema 'appflows'" in refused
