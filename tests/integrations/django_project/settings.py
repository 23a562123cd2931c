"""A tiny Django project whose tasks run on stepstone (tests/integrations/test_django_tasks.py runs its
tests with Django's own test runner, `django-admin test`, against real PostgreSQL)."""

import os
from urllib.parse import parse_qsl, urlsplit

_url = urlsplit(os.environ["SHOP_DATABASE_URL"])
_socket_dir = dict(parse_qsl(_url.query)).get("host")  # the embedded test server listens on a socket only

SECRET_KEY = "test-only"  # noqa: S105
USE_TZ = True
INSTALLED_APPS = ["django_tasks", "shop"] if os.environ.get("SHOP_TASKS_APP") else ["shop"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ["SHOP_DATABASE_NAME"],
        "USER": _url.username or "postgres",
        "PASSWORD": _url.password or "",
        "HOST": _url.hostname or _socket_dir or "127.0.0.1",
        "PORT": str(_url.port or 5432),
        "TEST": {"NAME": os.environ["SHOP_TEST_DATABASE_NAME"]},
    }
}
TASKS = {"default": {"BACKEND": "stepstone.integrations.django_tasks.StepstoneBackend"}}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
