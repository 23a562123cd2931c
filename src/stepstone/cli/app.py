"""``--app module:attribute``: import the workflows a command works with.

The attribute may be a `Registry` or a single `Workflow` (wrapped in a Registry). The current
directory is put on ``sys.path`` first, as uvicorn does, so ``--app myproject.flows:registry``
works from the project root without installing anything.

The module may name the database its workflows live on with a function ``stepstone_database()`` returning
`Settings` (database_url, schema and their sources), as `stepstone.integrations.django_tasks` does with the
Django database: the command then uses that database and schema when none is configured, and refuses a
configured one (flag, environment, pyproject) that names another, since it would never see that app's work.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from stepstone.authoring.workflow import Registry, Workflow
from stepstone.cli.common import SETTINGS_FOR_APP, CliError, RootOptions
from stepstone.config import Settings
from stepstone.errors import StepstoneError
from stepstone.store.dsn import redact_url, same_database

__all__ = ["APP_DATABASE_HOOK", "APP_ENV", "app_database", "app_option", "import_attribute", "load_app",
           "settings_for_app"]

APP_ENV = "STEPSTONE_APP"
APP_DATABASE_HOOK = "stepstone_database"
F = TypeVar("F", bound=Callable[..., Any])


def load_app(spec: str) -> Registry:
    """Import ``module:attribute`` and return it as a Registry; CliError with one line otherwise."""
    value = import_attribute(spec, "--app", "myapp.flows:registry")
    if isinstance(value, Registry):
        return value
    if isinstance(value, Workflow):
        try:
            return Registry(value)
        except StepstoneError as exc:
            raise CliError(f"{spec}: {_one_line(exc)}") from exc
    raise CliError(f"{spec} is a {type(value).__name__}, not a stepstone Registry or Workflow")


def import_attribute(spec: str, option: str, example: str) -> Any:
    """Import ``module:attribute`` (the current directory first on the path); CliError with one line."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise CliError(f"{option} must look like module:attribute (e.g. {example}), got {spec!r}")
    if any(c in module_name for c in "/\\") or module_name.startswith("."):
        # no module's name holds a slash, and a relative one has no package to start from here
        raise _file_path(spec, option)
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            if module_name.endswith(".py"):
                raise _file_path(spec, option) from exc
            raise CliError(f"cannot import {module_name!r}: no module named {exc.name!r} "
                           f"(looked in {cwd} and the installed packages)") from exc
        raise CliError(f"importing {module_name!r} failed: {_one_line(exc)}") from exc
    except Exception as exc:  # any error in the user's module becomes one line
        raise CliError(f"importing {module_name!r} failed: {_one_line(exc)}") from exc
    value: Any = module
    for part in attribute.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise CliError(f"module {module_name!r} has no attribute {attribute!r}") from None
    return value


def _file_path(spec: str, option: str) -> CliError:
    """The error of a file path given where a module's dotted name goes (``flows/orders.py:registry``)."""
    module_name, _, attribute = spec.partition(":")
    parts = [p for p in module_name.removesuffix(".py").replace("\\", "/").split("/") if p not in ("", ".")]
    return CliError(f"{option} takes a module's dotted name, not a file path: {'.'.join(parts)}:{attribute} "
                    f"(from the directory the path starts in), not {spec!r}")


def app_database(spec: str) -> Settings | None:
    """The database the (already imported) module of ``spec`` names with ``stepstone_database()``, if any."""
    hook = getattr(sys.modules.get(spec.partition(":")[0]), APP_DATABASE_HOOK, None)
    if not callable(hook):
        return None
    try:
        named = hook()
    except StepstoneError as exc:
        raise CliError(f"{spec}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    except Exception as exc:  # any error in the user's hook becomes one line
        raise CliError(f"{spec}: {APP_DATABASE_HOOK}() failed: {_one_line(exc)}") from exc
    if not isinstance(named, Settings) or not named.database_url:
        raise CliError(f"{spec}: {APP_DATABASE_HOOK}() must return stepstone.config.Settings with a database_url")
    return named


def settings_for_app(settings: Settings, spec: str, named: Settings) -> Settings:
    """``settings`` on the database and schema the app named, where nothing was configured; CliError when
    something configured names another database or schema (its work would never be seen there)."""
    app_url, app_schema = named.database_url or "", named.schema
    app_source = named.sources.get("database_url", APP_DATABASE_HOOK)
    sources = dict(settings.sources)
    url = settings.database_url
    if url is None:
        url, sources["database_url"] = app_url, f"--app {spec}: {app_source}"
    elif not same_database(url, app_url):
        raise CliError(f"--app {spec} works on the database {redact_url(app_url)} ({app_source}), but "
                       f"{sources.get('database_url', 'the settings')} names {redact_url(url)}: "
                       "unset that, or make it name the same database")
    schema = settings.schema
    if sources.get("schema", "default") == "default":
        schema, sources["schema"] = app_schema, f"--app {spec}: {named.sources.get('schema', APP_DATABASE_HOOK)}"
    elif schema != app_schema:
        raise CliError(f"--app {spec} works in the schema {app_schema!r} ({named.sources.get('schema', app_source)}), "
                       f"but {sources['schema']} names {schema!r}: unset that, or make it the same schema")
    return Settings(database_url=url, schema=schema, sources=sources, broker_url=settings.broker_url)


def app_option(*, required: bool) -> Callable[[F], F]:
    """Add ``--app`` (env STEPSTONE_APP); the command receives the loaded ``registry`` (or None)."""

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, app: str | None, **kwargs: Any) -> Any:
            if app is None:  # `stepstone --app X start ...`: the root group's flag, then the environment
                root = click.get_current_context().find_object(RootOptions)
                app = (root.app if root is not None else None) or os.environ.get(APP_ENV) or None
            if app is None and required:
                raise CliError(f"no workflows to work with: pass --app module:attribute or set {APP_ENV}")
            registry = load_app(app) if app else None
            named = app_database(app) if app else None
            if app and named is not None:  # read by `with_settings`, which runs inside this wrapper
                click.get_current_context().meta[SETTINGS_FOR_APP] = functools.partial(
                    settings_for_app, spec=app, named=named)
            return func(*args, registry=registry, **kwargs)

        return click.option(
            "--app",
            default=None,
            metavar="MODULE:ATTR",
            help=f"The Registry (or Workflow) to use, e.g. myapp.flows:registry [env {APP_ENV}].",
        )(wrapper)  # type: ignore[return-value]

    return decorate


def _one_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
