"""`stepstone worker --app stepstone.integrations.django_tasks:registry` works on the database the Django
backend writes to (docs/integrations.md): with no database configured it takes the Django database, and
it refuses a configured one that names another database, or no Django settings at all. Each worker is a
real process (the Django settings are global to a process) started outside any project, so a worker that
fell back to the embedded default would start it in the test's own directory and be seen there."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from stepstone.cli.app import settings_for_app
from stepstone.cli.common import CliError
from stepstone.client import Client
from stepstone.config import Settings
from stepstone.store.postgres import PostgresStore
from tests._pg import PgServer, _stop_embedded
from tests.test_cli_worker import STEPSTONE, WorkerProcess

PROJECT = Path(__file__).resolve().parent / "django_project"
APP = "stepstone.integrations.django_tasks:registry"
DEADLINE = 30.0
ENQUEUE = "import django; django.setup(); from shop.tasks import add; print(add.enqueue(2, 3).id)"
django = pytest.importorskip("django", reason="Django is in the test extra")


def _framework() -> str:
    try:
        import django.tasks  # noqa: F401, PLC0415
    except ImportError:
        pytest.importorskip("django_tasks", reason="neither django.tasks nor the django-tasks package")
        return "django_tasks"
    return "django.tasks"


def _django_env(pg_server: PgServer, database: str, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if key not in ("STEPSTONE_DATABASE_URL", "DATABASE_URL", "STEPSTONE_SCHEMA", "DJANGO_SETTINGS_MODULE")}
    env.update({"DJANGO_SETTINGS_MODULE": "settings", "SHOP_DATABASE_URL": pg_server.admin_url,
                "SHOP_DATABASE_NAME": database, "SHOP_TEST_DATABASE_NAME": f"{database}_unused",
                "PYTHONPATH": os.pathsep.join([str(PROJECT), os.environ.get("PYTHONPATH", "")]),
                "PYTHONUNBUFFERED": "1", **extra})
    if _framework() == "django_tasks":
        env["SHOP_TASKS_APP"] = "1"
    return env


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[Path]:
    """A directory in no project; an embedded server started there (the defect) is stopped afterwards."""
    yield tmp_path
    if (tmp_path / ".stepstone" / "pg").exists():
        _stop_embedded(tmp_path / ".stepstone" / "pg")


async def _spawn(cwd: Path, env: dict[str, str], *args: str) -> WorkerProcess:
    proc = await asyncio.create_subprocess_exec(
        *STEPSTONE, *args, cwd=cwd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env)
    return WorkerProcess(proc)


async def test_the_worker_serves_the_django_database(pg_server: PgServer, database_url: str, outside: Path) -> None:
    database = urlsplit(database_url).path.lstrip("/")  # a migrated database: the Django project's
    env = _django_env(pg_server, database)
    worker = await _spawn(outside, env, "worker", "--app", APP, "--poll-interval", "0.2")
    try:
        started = await worker.line_containing("started")
        # the test server's database: by its socket (?host=) on the embedded server, by host:port on a
        # server given by URL (STEPSTONE_TEST_DATABASE_URL, as CI's second phase)
        assert (f"/{database}?host=" in started or f"/{database} (schema stepstone)" in started) \
            and "(schema stepstone)" in started, started
        assert not (outside / ".stepstone").exists()
        enqueue = await asyncio.create_subprocess_exec(
            sys.executable, "-c", ENQUEUE,
            cwd=PROJECT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(enqueue.communicate(), DEADLINE)
        assert enqueue.returncode == 0, err.decode()
        store = await PostgresStore.open(database_url)
        try:
            done = await Client(store).wait_for(out.decode().strip(), timeout=DEADLINE)
        finally:
            await store.close()
        assert (done.status, done.state["status"], done.state["result"]) == ("COMPLETED", "SUCCESSFUL", 5)
        worker.proc.send_signal(signal.SIGTERM)
        assert await worker.exit_code(timeout=DEADLINE) == 0
    finally:
        if worker.proc.returncode is None:
            worker.proc.kill()
            await worker.proc.wait()


async def _refusal(cwd: Path, env: dict[str, str], *args: str) -> str:
    proc = await _spawn(cwd, env, "worker", "--app", APP, *args)
    code = await proc.exit_code(timeout=DEADLINE)
    text = "".join(proc.lines)
    assert code == 1, text
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    return lines[0]


async def test_a_configured_url_naming_another_database_is_refused(pg_server: PgServer, outside: Path) -> None:
    other = "postgresql://someone:pw-1234@127.0.0.1:1/not_the_django_database"  # refused before connecting
    env = _django_env(pg_server, "the_django_database", STEPSTONE_DATABASE_URL=other)
    line = await _refusal(outside, env)
    assert "/the_django_database" in line and "env STEPSTONE_DATABASE_URL names" in line, line
    assert "not_the_django_database" in line and "pw-1234" not in line, line
    assert not (outside / ".stepstone").exists()


async def test_a_configured_schema_that_differs_is_refused(pg_server: PgServer, outside: Path) -> None:
    line = await _refusal(outside, _django_env(pg_server, "db"), "--schema", "elsewhere")
    assert "schema 'stepstone'" in line and "--schema names 'elsewhere'" in line, line


async def test_without_django_settings_the_worker_refuses(pg_server: PgServer, outside: Path) -> None:
    env = _django_env(pg_server, "db")
    del env["DJANGO_SETTINGS_MODULE"]
    line = await _refusal(outside, env)
    assert "set DJANGO_SETTINGS_MODULE" in line, line
    assert not (outside / ".stepstone").exists()


APP_DB = Settings(database_url="postgresql://app:pw@db.example:5432/shop", schema="tasks",
                  sources={"database_url": "TASKS", "schema": "TASKS"})


def test_the_apps_database_fills_in_what_is_not_configured() -> None:
    fitted = settings_for_app(Settings(sources={"database_url": "default", "schema": "default"}), "m:r", APP_DB)
    assert (fitted.database_url, fitted.schema) == (APP_DB.database_url, "tasks")
    assert fitted.sources["database_url"] == "--app m:r: TASKS"


def test_a_configured_url_for_the_same_database_is_kept() -> None:
    configured = Settings(database_url="postgres://worker@db.example/shop?sslmode=require", schema="tasks",
                          sources={"database_url": "env DATABASE_URL", "schema": "env STEPSTONE_SCHEMA"})
    assert settings_for_app(configured, "m:r", APP_DB) == configured
    elsewhere = Settings(database_url="postgresql://app@db.example:5433/shop",
                         sources={"database_url": "--database-url", "schema": "default"})
    with pytest.raises(CliError, match=re.escape("--database-url names postgresql://app@db.example:5433/shop")):
        settings_for_app(elsewhere, "m:r", APP_DB)
