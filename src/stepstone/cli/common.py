"""Helpers shared by CLI command modules: settings options, output format, async runner, errors."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
import signal
import socket
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import click

from stepstone.cli.addresses import host_port
from stepstone.config import load_settings
from stepstone.core.limits import DEFAULT_LIMITS, MAX_INT4, MAX_INT8, PayloadRejected
from stepstone.core.timestamps import MAX_SECONDS
from stepstone.errors import StepstoneError

__all__ = [
    "DURATION_FORMS",
    "FREE_TEXT",
    "SETTINGS_FOR_APP",
    "TEXT",
    "CliError",
    "Duration",
    "Interrupted",
    "RootOptions",
    "Text",
    "emit",
    "is_duration",
    "json_value",
    "output_option",
    "parse_duration",
    "render_table",
    "run_async",
    "settings_options",
    "shown_duration",
    "with_settings",
]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
SETTINGS_FOR_APP = "stepstone.settings_for_app"
"""The key of ``ctx.meta`` where ``--app`` leaves a function fitting the settings to the app's own database."""


class CliError(click.ClickException):
    """A one-line error on stderr and exit code 1 (``exit_code`` may be overridden)."""

    exit_code = 1

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", file=file, err=True)


class Interrupted(CliError):
    """Ctrl-C on a command (`run_async`): exit 128 + SIGINT, as a shell reports a process SIGINT ended."""

    exit_code = 128 + signal.SIGINT


if TYPE_CHECKING:
    _ParamType = click.ParamType[str, Any]
    _SecondsType = click.ParamType[float | None, Any]
else:  # click before 8.2 has no type parameters at run time
    _ParamType = _SecondsType = click.ParamType


class Text(_ParamType):
    """A text argument checked before anything connects, by the same `Limits.check_text` the client
    uses: no NUL, no undecodable bytes (they arrive as lone surrogates), within its length limit."""

    name = "text"

    def __init__(self, *, free: bool = False, empty: bool = False) -> None:
        self.free = free
        self.empty = empty

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None,  # noqa: ARG002 - click's signature
    ) -> str:
        what = "value"
        if isinstance(param, click.Option) and param.opts:
            what = max(param.opts, key=len)
        elif param is not None:
            what = param.human_readable_name
        try:
            return DEFAULT_LIMITS.check_text(what, value, free=self.free, empty=self.empty)
        except PayloadRejected as exc:
            raise CliError(str(exc)) from None


TEXT = Text()
FREE_TEXT = Text(free=True, empty=True)  # a reason, a URL: the longer limit, empty allowed

# Integers as the columns they reach hold them: a larger one is a usage error, not the driver's traceback.
INT4 = click.IntRange(-MAX_INT4 - 1, MAX_INT4)
VERSION = click.IntRange(1, MAX_INT4)  # a workflow version (or a task's shown data's)
EVENT_ID = click.IntRange(1, MAX_INT8)  # an outbox event's id
SEQ = click.IntRange(0, MAX_INT4)  # a history entry's sequence number (0: before the first)


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
DURATION_FORMS = "seconds (90) or 90s, 15m, 2h, 30d, 1w"


def is_duration(text: str) -> bool:
    """Whether `text` has a duration's form with a unit (`90s`, `2h`), to tell it from an instant."""
    match = _DURATION.match(text.strip().lower())
    return match is not None and match.group(2) is not None


def duration_seconds(text: str) -> float:
    """The one reading of a duration the CLI is given: a bare number is seconds, or `90s`, `15m`, `2h`,
    `30d`, `1w`; at most `core.timestamps.MAX_DURATION` (a longer one failed the statement, or did not fit a
    timedelta at all). ValueError, worded for the option's name to go before it, otherwise."""
    match = _DURATION.match(text.strip().lower())
    if match is None:
        raise ValueError(f"{text!r} is not a duration: give {DURATION_FORMS}")
    seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    if seconds > MAX_SECONDS:
        raise ValueError(f"{text!r} is longer than a thousand years")
    return seconds


def parse_duration(text: str, what: str) -> timedelta:
    """`duration_seconds` as a timedelta, or a CliError naming `what`."""
    try:
        return timedelta(seconds=duration_seconds(text))
    except ValueError as exc:
        raise CliError(f"{what} {exc}") from None


def shown_duration(seconds: float) -> str:
    """`seconds` in the largest unit that holds it whole (900 -> 15m), as a duration option takes it."""
    for unit, size in sorted(_UNITS.items(), key=lambda item: -item[1]):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


class Finite(click.FloatRange):
    """A number from `low` to `high`. click's FloatRange lets NaN through (no comparison fails for it),
    which reached the server as 'interval out of range'."""

    def __init__(self, low: float, high: float = MAX_SECONDS) -> None:
        super().__init__(min=low, max=high)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if math.isnan(number):
            self.fail(f"{value!r} is not a number", param, ctx)
        return number


class Duration(_SecondsType):
    """The type of every CLI option that takes a length of time: seconds, a bare number (`90`) or with a
    unit (`90s`, `15m`, `2h`, `30d`, `1w`, `duration_seconds`), from `low` to a thousand years; with `never`,
    also the word never (None). A value it refuses is a usage error worded the same for every option."""

    name = "duration"

    def __init__(self, low: float = 0, *, never: bool = False) -> None:
        self.low = low
        self.never = never

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float | None:
        if value is None or (isinstance(value, float | int) and not isinstance(value, bool)):
            return None if value is None else float(value)  # a default given as a number
        text = str(value)
        if self.never and text.strip().lower() == "never":
            return None
        try:
            seconds = duration_seconds(text)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        if seconds < self.low:
            self.fail(f"{text!r} is too short: at least {shown_duration(self.low)}", param, ctx)
        return seconds


@dataclass
class RootOptions:
    """Options given to the root group, kept in ``ctx.obj``."""

    database_url: str | None = None
    schema: str | None = None
    app: str | None = None


def settings_options(func: F) -> F:
    """Add ``--database-url`` and ``--schema`` to a group or command."""
    func = click.option(
        "--schema",
        default=None,
        metavar="NAME",
        help="PostgreSQL schema holding stepstone's tables [env STEPSTONE_SCHEMA; default stepstone].",
    )(func)
    return click.option(
        "--database-url",
        default=None,
        type=FREE_TEXT,
        metavar="URL",
        help="postgresql://user:password@host:port/dbname [env STEPSTONE_DATABASE_URL, DATABASE_URL; "
        "default: embedded PostgreSQL in .stepstone/pg].",
    )(func)


def with_settings(func: Callable[..., T]) -> Callable[..., T]:
    """Give the command resolved ``settings`` (command flags beat root flags beat env and pyproject)."""

    @functools.wraps(func)
    def wrapper(*args: Any, database_url: str | None, schema: str | None, **kwargs: Any) -> T:
        ctx = click.get_current_context()
        root = ctx.find_object(RootOptions) or RootOptions()
        try:
            settings = load_settings(
                database_url=database_url if database_url is not None else root.database_url,
                schema=schema if schema is not None else root.schema,
            )
        except StepstoneError as exc:
            raise CliError(str(exc)) from exc
        for_app = ctx.meta.get(SETTINGS_FOR_APP)  # an --app that names its database (cli/app.py)
        if for_app is not None:
            settings = for_app(settings)
        return func(*args, settings=settings, **kwargs)

    return settings_options(wrapper)


def output_option(func: F) -> F:
    """Add ``-o/--output [table|json]`` (passed as ``output``)."""
    return click.option(
        "-o",
        "--output",
        type=click.Choice(["table", "json"]),
        default="table",
        show_default=True,
        help="Output format.",
    )(func)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro``; a StepstoneError becomes a one-line message and exit code 1, and Ctrl-C (SIGINT, which
    cancels ``coro``) ``error: interrupted`` and 130 (128 + SIGINT), not click's "Aborted!" and 1."""
    try:
        return asyncio.run(coro)
    except StepstoneError as exc:
        raise CliError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    except KeyboardInterrupt:
        raise Interrupted("interrupted") from None


def render_table(rows: Sequence[Sequence[Any]], headers: Sequence[str] | None = None) -> str:
    """Left-aligned columns separated by two spaces."""
    all_rows = [list(map(str, headers))] if headers else []
    all_rows += [["" if cell is None else str(cell) for cell in row] for row in rows]
    if not all_rows:
        return ""
    widths = [max(len(row[i]) for row in all_rows if i < len(row)) for i in range(len(all_rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in all_rows
    )


def json_value(value: Any) -> Any:
    """What `-o json` writes for a value JSON has no type for: a time in ISO 8601 (as the API answers),
    a duration in seconds, anything else (a UUID, ...) as its text."""
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    return str(value)


def emit(data: Any, output: str, table: Callable[[], str]) -> None:
    """Print ``data`` as JSON (every command's `-o json` comes through here), or the text ``table()`` builds."""
    if output == "json":
        click.echo(json.dumps(data, indent=2, default=json_value, sort_keys=False))
    else:
        click.echo(table())


def listening_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so a port in use is one clear line (and --port 0 picks one)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CliError(f"cannot listen on {host_port(host, port)}: {exc.strerror or exc}") from None
    return sock
