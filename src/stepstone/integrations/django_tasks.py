"""A backend for Django's tasks framework (the `TASKS` setting), backed by stepstone.

    TASKS = {
        "default": {
            "BACKEND": "stepstone.integrations.django_tasks.StepstoneBackend",
            "OPTIONS": {"schema": "stepstone"},   # database_url: default, the Django database's
        }
    }

and a worker beside the app (with DJANGO_SETTINGS_MODULE set):
`stepstone worker --app stepstone.integrations.django_tasks:registry`. The worker works on the database
the backend writes to: `stepstone_database()` below names it to the CLI (docs/integrations.md).

Each enqueued task is an instance of the workflow `django.task`: a timer until `run_after` (now when
not deferred), then one step that calls the task. Inside `transaction.atomic()` the enqueue is written
by Django's own transaction (its psycopg 3 connection, `Client.start(connection=...)`): the task exists
exactly when the transaction commits. A task that raises ends FAILED with its exception class and
traceback, and is not retried (Django's semantics). Async task functions run to completion in the step
(the worker runs the step in a thread of its own), and a task that takes a context gets one whose
`task_result` is this run's. Works with Django 6's `django.tasks` and with the `django-tasks` package on
earlier Django versions.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import traceback
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any
from urllib.parse import quote

from django.core.signals import setting_changed
from pydantic import BaseModel

from stepstone.authoring.workflow import Registry, Retry, StepContext, Workflow
from stepstone.config import DEFAULT_SCHEMA, Settings
from stepstone.errors import ConfigError

try:  # Django 6
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import TaskContext, TaskError, TaskResult, TaskResultStatus
    from django.tasks.exceptions import TaskResultDoesNotExist
    from django.utils.json import normalize_json
except ImportError:  # the django-tasks package (Django 4.2 - 5.x)
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import TaskContext, TaskError, TaskResult, TaskResultStatus
    from django_tasks.exceptions import TaskResultDoesNotExist
    from django_tasks.utils import normalize_json

__all__ = ["StepstoneBackend", "django_task", "registry", "stepstone_database"]

WORKFLOW = "django.task"


class DjangoTask(BaseModel):
    """The state of one enqueued task."""

    task: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    queue_name: str = "default"
    backend: str = "default"
    run_after: str
    status: str = "READY"
    result: Any = None
    error: dict[str, str] | None = None
    started_at: str | None = None
    finished_at: str | None = None


django_task: Workflow[DjangoTask] = Workflow(WORKFLOW, version=1, state=DjangoTask)
django_task.timer("not_before", until="run_after", next="run", start=True)


def _module_path(obj: Any) -> str:
    """The dotted path Django records for a task function or an exception class (both versions agree)."""
    return f"{obj.__module__}.{obj.__qualname__}"


def _now() -> str:
    from django.utils import timezone  # noqa: PLC0415

    return str(timezone.now().isoformat())


@django_task.step(retry=Retry(max_attempts=1))
def run(ctx: StepContext, state: DjangoTask) -> None:
    """Call the task; its outcome is the instance's state (a task's failure ends the instance, FAILED)."""
    _setup_django()
    from django.utils.module_loading import import_string  # noqa: PLC0415

    state.started_at = _now()
    try:
        task = import_string(state.task)
        if task.takes_context:  # this run's result, as Django's own backends pass it
            running = _task_result(task, ctx.instance_id, state, TaskResultStatus.RUNNING, None,
                                   worker_ids=[f"{socket.gethostname()}:{os.getpid()}"])
            value = task.call(TaskContext(task_result=running), *state.args, **state.kwargs)
        else:
            value = task.call(*state.args, **state.kwargs)  # an async function: run to its end here
        state.result = normalize_json(value)
        state.status = "SUCCESSFUL"
    except Exception as exc:  # noqa: BLE001 - a task's error is its result, as in Django's own backends
        state.status = "FAILED"
        state.error = {"exception_class_path": _module_path(type(exc)),
                       "traceback": "".join(traceback.format_exception(exc))}
    state.finished_at = _now()


registry = Registry(django_task)

_setup_lock = threading.Lock()


def _setup_django() -> None:
    """A worker process started by `stepstone worker` sets Django up once, from DJANGO_SETTINGS_MODULE."""
    from django.apps import apps  # noqa: PLC0415

    if apps.ready:
        return
    with _setup_lock:
        if not apps.ready:
            import django  # noqa: PLC0415

            django.setup()


def _database_url(alias: str = "default") -> str:
    from django.db import connections  # noqa: PLC0415

    s = connections[alias].settings_dict
    user = quote(s.get("USER") or "", safe="")
    password = quote(s.get("PASSWORD") or "", safe="")
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = s.get("HOST") or "localhost"
    name = quote(s["NAME"], safe="")
    if host.startswith("/"):  # a Unix socket directory goes in the query, as libpq reads it
        port = f"&port={s['PORT']}" if s.get("PORT") else ""
        return f"postgresql://{auth}/{name}?host={quote(host, safe='/')}{port}"
    port = f":{s['PORT']}" if s.get("PORT") else ""
    return f"postgresql://{auth}{host}{port}/{name}"


def _target(options: Mapping[str, Any]) -> tuple[str, str]:
    """The database URL and schema a backend with these OPTIONS writes to."""
    url = options.get("database_url") or _database_url(options.get("database", "default"))
    return url, options.get("schema") or DEFAULT_SCHEMA


def stepstone_database() -> Settings:
    """The database and schema the stepstone backends of TASKS write to. The CLI asks an --app module for
    it, so `stepstone worker --app stepstone.integrations.django_tasks:registry` serves them when no database
    is configured, and refuses a configured one that names another database."""
    from django.conf import settings  # noqa: PLC0415
    from django.core.exceptions import ImproperlyConfigured  # noqa: PLC0415
    from django.utils.module_loading import import_string  # noqa: PLC0415

    try:
        tasks = getattr(settings, "TASKS", None) or {}
    except ImproperlyConfigured:
        raise ConfigError("the Django settings are not configured: set DJANGO_SETTINGS_MODULE (e.g. "
                          "DJANGO_SETTINGS_MODULE=mysite.settings), whose TASKS name the database") from None
    except ImportError as exc:
        raise ConfigError(f"cannot import the Django settings {settings.SETTINGS_MODULE!r}: {exc}") from None
    where = f"TASKS in {settings.SETTINGS_MODULE}"
    targets: dict[tuple[str, str], list[str]] = {}
    for alias, entry in tasks.items():
        try:
            backend = import_string(entry.get("BACKEND", ""))
        except ImportError:
            continue  # not ours; Django itself says what is wrong with it
        if isinstance(backend, type) and issubclass(backend, StepstoneBackend):
            targets.setdefault(_target(entry.get("OPTIONS") or {}), []).append(alias)
    if not targets:
        raise ConfigError(f"{where}: no backend is {__name__}.StepstoneBackend, so there are no tasks to run")
    if len(targets) > 1:
        aliases = sorted(alias for names in targets.values() for alias in names)
        raise ConfigError(f"{where}: the stepstone backends {aliases} write to different databases or schemas; "
                          "a worker serves one: give them the same database_url and schema")
    [(target, aliases)] = targets.items()
    source = f"TASKS[{aliases[0]!r}] in {settings.SETTINGS_MODULE}"
    return Settings(database_url=target[0], schema=target[1], sources={"database_url": source, "schema": source})


_shared: dict[tuple[str, str], Any] = {}  # the SyncClient the backends of one database and schema share
_holding: weakref.WeakSet[StepstoneBackend] = weakref.WeakSet()  # the backends that hold a shared client
_calls: Counter[tuple[str, str]] = Counter()  # the backends' calls in flight on each shared client
_shared_lock = threading.Lock()


def _unused(target: tuple[str, str]) -> Any:
    """The shared client of `target`, taken out of `_shared` to be closed, when no backend holds it and no
    backend's call is in flight on it; else None. Called with `_shared_lock` held."""
    # The holders are the backends in _holding with this target (a backend Django dropped and the
    # collector took holds nothing).
    if _calls[target] or any(b._held == target for b in _holding):
        return None
    _calls.pop(target, None)
    return _shared.pop(target, None)


def _let_go_on_tasks_change(*, setting: str, **_: Any) -> None:
    """A change of TASKS (`override_settings`) makes Django drop its backends of every thread for new ones
    without closing them: their holds kept the shared client open until the process exited. Each backend
    holding one lets go of it here, and the client is closed once no backend holds it and the calls in
    flight on it (another thread's) have returned; one still referenced takes a client again on its next
    call."""
    if setting != "TASKS":
        return
    with _shared_lock:
        backends = list(_holding)
    for backend in backends:
        backend.close()


setting_changed.connect(_let_go_on_tasks_change, dispatch_uid=f"{__name__}.let_go_on_tasks_change")


class StepstoneBackend(BaseTaskBackend):  # type: ignore[misc]
    """Django tasks as stepstone instances: durable, retried on a crash, run by any `stepstone worker`."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = False

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self._held: tuple[str, str] | None = None  # the target of the shared client this backend holds

    def client(self) -> Any:
        """The blocking client of the backend's database (opened on first use, on the Django database unless
        configured). Django keeps a backend per thread; the backends of one database and schema share one
        client (one loop thread, one pool), which a SyncClient allows: each call waits for its own task."""
        with _shared_lock:
            return self._take()

    def _take(self) -> Any:
        """`client()`, with `_shared_lock` held."""
        target = self._held or _target(self.options)
        client = _shared.get(target)
        if client is None:
            from stepstone._sync_client import SyncClient  # noqa: PLC0415

            client = _shared[target] = SyncClient(target[0], schema=target[1], registry=registry)
        self._held = target
        _holding.add(self)
        return client

    @contextlib.contextmanager
    def _calling(self) -> Iterator[Any]:
        """The shared client for one call of the backend, in flight until the block ends: a release meanwhile
        (`close()`, a change of TASKS from another thread) leaves the client open for it, and the end of the
        last call closes a client no backend holds any more."""
        with _shared_lock:
            client = self._take()
            target = self._held
            assert target is not None  # (set by _take)
            _calls[target] += 1
        try:
            yield client
        finally:
            with _shared_lock:
                _calls[target] -= 1
                unused = _unused(target)
            if unused is not None:
                unused.close()

    def close(self) -> None:
        """Let go of the shared client; it is closed when no backend holds it and no backend's call on it
        is in flight (the last such call's end closes it then)."""
        with _shared_lock:
            target, self._held = self._held, None
            _holding.discard(self)
            unused = None if target is None else _unused(target)
        if unused is not None:
            unused.close()

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        self.validate_task(task)
        run_after = task.run_after.isoformat() if task.run_after is not None else _now()
        state = {"task": _module_path(task.func), "args": normalize_json(list(args)),
                 "kwargs": normalize_json(dict(kwargs)), "queue_name": task.queue_name, "backend": self.alias,
                 "run_after": run_after}
        with self._calling() as client:
            iid = client.start(WORKFLOW, state, connection=self._atomic_connection())
        return self._result(task, iid, DjangoTask(**state), None, None)

    def _atomic_connection(self) -> Any:
        """Django's psycopg 3 connection while inside `transaction.atomic()`, so the task commits with it."""
        if not self.options.get("transactional", True):
            return None
        from django.db import connections  # noqa: PLC0415

        conn = connections[self.options.get("database", "default")]
        if not conn.in_atomic_block or conn.vendor != "postgresql":
            return None
        raw = conn.connection
        return raw if type(raw).__module__.startswith("psycopg") else None

    def get_result(self, result_id: str) -> Any:
        from stepstone.errors import InstanceNotFound  # noqa: PLC0415

        with self._calling() as client:
            try:
                info = client.get(result_id)
            except InstanceNotFound:
                raise TaskResultDoesNotExist(result_id) from None
            if info.definition_id != WORKFLOW:
                raise TaskResultDoesNotExist(result_id)
            state = DjangoTask(**info.state)
            status = info.status
            if status == "WAITING" and state.status == "READY" and _claimed(client, info.id):
                status = "RUNNING"
        from django.utils.module_loading import import_string  # noqa: PLC0415

        return self._result(import_string(state.task), info.id, state, info.created_at, status)

    def _result(self, task: Any, iid: str, state: DjangoTask, enqueued_at: datetime | None,
                status: str | None) -> Any:
        """Django's status: FAILED for an instance that failed or was cancelled, the task's own outcome once
        it ran, RUNNING while a worker runs it (the instance RUNNING at `run`, or its timer claimed), else
        READY (enqueued, waiting for `run_after` or a worker)."""
        if status in ("FAILED", "CANCELLED"):
            outcome = TaskResultStatus.FAILED
        elif state.status in ("SUCCESSFUL", "FAILED"):
            outcome = TaskResultStatus(state.status)
        elif status == "RUNNING":
            outcome = TaskResultStatus.RUNNING
        else:
            outcome = TaskResultStatus.READY
        return _task_result(task, iid, state, outcome, enqueued_at)


def _claimed(client: Any, iid: str) -> bool:
    """A worker runs the task: it holds the due timer into `run` (the step runs in that command's
    segment, and the instance reads WAITING at `not_before` until their one commit) or `run`'s command."""
    detail = client.detail(iid)
    return any(c["state"] == "CLAIMED" for c in detail.timers) or any(
        c["state"] == "CLAIMED" and c["step"] == "run" for c in detail.commands)


def _task_result(task: Any, iid: str, state: DjangoTask, outcome: Any, enqueued_at: datetime | None,
                 worker_ids: list[str] | None = None) -> Any:
    """Django's TaskResult of the instance `iid` whose state is `state`."""
    errors = [TaskError(**state.error)] if state.error else []
    started = datetime.fromisoformat(state.started_at) if state.started_at else None
    result = TaskResult(
        task=task, id=iid, status=outcome, enqueued_at=enqueued_at, started_at=started,
        last_attempted_at=started,
        finished_at=datetime.fromisoformat(state.finished_at) if state.finished_at else None,
        args=state.args, kwargs=state.kwargs, backend=state.backend, errors=errors,
        worker_ids=worker_ids or [],
    )
    object.__setattr__(result, "_return_value", state.result)
    return result
