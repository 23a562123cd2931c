"""The Django task backend, tested by Django's own test runner (`django-admin test`) in a subprocess,
against real PostgreSQL: a tiny project in tests/integrations/django_project."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests._pg import PgServer

PROJECT = Path(__file__).resolve().parent / "django_project"
django = pytest.importorskip("django", reason="Django is in the test extra")


def _tasks_module() -> str | None:
    try:
        import django.tasks  # noqa: F401, PLC0415
    except ImportError:
        try:
            import django_tasks  # noqa: F401, PLC0415
        except ImportError:
            return None
        return "django_tasks"
    return "django.tasks"


def test_the_backend_under_djangos_test_runner(pg_server: PgServer) -> None:
    tasks = _tasks_module()
    # .ci/run's Django 6 section sets it: there a missing django.tasks is a failure, not a skip.
    required = os.environ.get("STEPSTONE_TEST_DJANGO_TASKS")
    if required is not None:
        assert tasks == required, f"the tasks framework is {tasks}, not {required} (Django {django.__version__})"
    if tasks is None:
        pytest.skip("neither django.tasks (Django 6) nor the django-tasks package is installed")
    base = pg_server.create_database()
    test_name = f"stepstone_django_{uuid.uuid4().hex[:10]}"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "settings", "SHOP_DATABASE_URL": pg_server.admin_url,
           "SHOP_DATABASE_NAME": base, "SHOP_TEST_DATABASE_NAME": test_name, "SHOP_TASKS_FRAMEWORK": tasks,
           "PYTHONPATH": os.pathsep.join([str(PROJECT), os.environ.get("PYTHONPATH", "")]),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if tasks == "django_tasks":
        env["SHOP_TASKS_APP"] = "1"
    try:
        proc = subprocess.run([sys.executable, "-m", "django", "test", "shop", "--noinput", "-v", "2"],
                              cwd=PROJECT, env=env, capture_output=True, text=True, timeout=300, check=False)
    finally:
        pg_server.drop_database(test_name)
        pg_server.drop_database(base)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Ran 12 tests" in proc.stderr and "OK" in proc.stderr
