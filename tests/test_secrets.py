"""Passwords never leak: redaction goes through a URL parser (userinfo and query), and the bench gives
its children the password through the environment, never on a command line `ps` shows."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from stepstone.bench import ceiling, procs, worker_proc
from stepstone.bench.common import BenchContext, Sizes
from stepstone.cli import cli
from stepstone.store.database import _scrub, redact_url
from stepstone.store.dsn import without_password

SECRET = "s3cr3t-pw"  # noqa: S105 - a made-up password the redaction must hide
REDACTED = [
    ("postgresql://bob:s3cr3t-pw@db.example:5432/app", "postgresql://bob:***@db.example:5432/app"),
    ("postgresql://bob:s3cr@t-pw@db.example/app", "postgresql://bob:***@db.example/app"),  # a raw @
    ("postgresql://bob:s3cr%40t-pw@db.example/app", "postgresql://bob:***@db.example/app"),
    ("postgresql://bob:s3cr:t-pw@db.example/app", "postgresql://bob:***@db.example/app"),  # a raw :
    ("postgresql://bob@db.example/app?password=s3cr3t-pw", "postgresql://bob@db.example/app?password=***"),
    ("postgresql://bob@db.example/app?connect_timeout=5&password=s3cr3t-pw&sslmode=require",
     "postgresql://bob@db.example/app?connect_timeout=5&password=***&sslmode=require"),
    ("postgresql://bob@db.example/app?sslpassword=s3cr3t-pw", "postgresql://bob@db.example/app?sslpassword=***"),
    ("postgresql://bob@db.example/app?passfile=/home/bob/s3cr3t-pw", "postgresql://bob@db.example/app?passfile=***"),
    ("postgresql://bob:s3cr3t-pw@[::1]:5432/app", "postgresql://bob:***@[::1]:5432/app"),
    ("postgresql://bob:s3cr3t-pw@/app?host=/run/postgresql", "postgresql://bob:***@/app?host=/run/postgresql"),
    ("host=db.example password=s3cr3t-pw dbname=app", "host=db.example password=*** dbname=app"),
    ("host=db.example password='s3cr3t pw' dbname=app", "host=db.example password=*** dbname=app"),
    ("postgresql://bob@/app?host=/tmp/x?password=s3cr3t-pw", "postgresql://bob@/app?host=/tmp/x?password=***"),
    ("postgresql://bob@db.example:5432/app", "postgresql://bob@db.example:5432/app"),
    # Echoed as written, only the secrets replaced: no "//" dropped, no empty "?" or "#" dropped.
    ("sqlite:///x.db", "sqlite:///x.db"),
    ("postgresql:///app?host=/run/postgresql&password=s3cr3t-pw", "postgresql:///app?host=/run/postgresql&password=***"),
    ("postgresql://bob:s3cr3t-pw@db.example/app?", "postgresql://bob:***@db.example/app?"),
    ("postgresql://bob:s3cr3t-pw@db.example/app#", "postgresql://bob:***@db.example/app#"),
]


@pytest.mark.parametrize(("url", "expected"), REDACTED, ids=[u for u, _ in REDACTED])
def test_redact_url_masks_every_form(url: str, expected: str) -> None:
    assert redact_url(url) == expected
    assert "s3cr" not in redact_url(url)


def test_driver_messages_are_scrubbed_of_every_secret() -> None:
    url = "postgresql://bob:pw%2Fone@db.example/app?sslpassword=two-secret"
    message = f"could not connect to {url}: password pw/one rejected, two-secret too\nsecond line"
    scrubbed = _scrub(message, url)
    assert "pw/one" not in scrubbed and "pw%2Fone" not in scrubbed and "two-secret" not in scrubbed
    assert "second line" not in scrubbed


def test_doctor_does_not_print_a_query_password(database_url: str) -> None:
    joined = f"{database_url}{'&' if '?' in database_url else '?'}password={SECRET}"
    result = CliRunner().invoke(cli, ["doctor", "--database-url", joined])
    assert SECRET not in result.output
    assert "password=***" in result.output


@pytest.mark.parametrize("url", [
    "postgresql://bob:s3cr3t-pw@db.example/app",
    "postgresql://bob:s3cr%40t-pw@db.example/app",
    "postgresql://bob@db.example/app?sslmode=require&password=s3cr3t-pw",
])
def test_pgbench_gets_the_password_in_its_environment(url: str, tmp_path: Path) -> None:
    ctx = BenchContext(admin_url=url, schema="stepstone", sizes=Sizes.quick(), concurrency=2, processes=1,
                       bin_dir=str(tmp_path))
    args, env = ceiling.pgbench_command(ctx, url, tmp_path / "script.sql")
    assert not any("s3cr" in a for a in args), args
    assert env["PGPASSWORD"] in ("s3cr3t-pw", "s3cr@t-pw")
    assert args[-1].startswith("postgresql://bob@db.example/app")


def test_without_password_keeps_everything_else() -> None:
    assert without_password("postgresql://bob@h/app?sslmode=require") == ("postgresql://bob@h/app?sslmode=require",
                                                                          None)
    assert without_password("postgresql://bob:a%3Ab@h:6/app?x=1&password=c") == ("postgresql://bob@h:6/app?x=1", "c")


def test_bench_workers_get_the_url_in_their_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"postgresql://bob:{SECRET}@db.example/app"
    args, env = procs.worker_command(url, "stepstone", "--concurrency", "4")
    assert not any(SECRET in a or "db.example" in a for a in args), args
    assert env[procs.URL_ENV] == url
    monkeypatch.setenv(procs.URL_ENV, url)
    parsed = worker_proc.parse(["--schema", "stepstone", "--concurrency", "4"])
    assert (parsed.url, parsed.concurrency) == (url, 4)
