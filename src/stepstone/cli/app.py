"""``--app module:attribute``: import the workflows a command works with.

The attribute may be a `Registry` or a single `Workflow` (wrapped in a Registry). The current
directory is put on ``sys.path`` first, as uvicorn does, so ``--app myproject.flows:registry``
works from the project root without installing anything.
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
from stepstone.cli.common import CliError, RootOptions
from stepstone.errors import StepstoneError

__all__ = ["APP_ENV", "app_option", "import_attribute", "load_app"]

APP_ENV = "STEPSTONE_APP"
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
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
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
            return func(*args, registry=load_app(app) if app else None, **kwargs)

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
