"""The ``stepstone`` command line: the root group and the registry of command modules.

To add commands, write a module in this package exposing ``commands`` (a list of click commands or
groups) and append it to ``_COMMAND_MODULES``.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import click

from stepstone import __version__
from stepstone.cli import (
    bench,
    db,
    definitions,
    demo,
    demo_approval,
    demo_fanout,
    demo_outbox,
    demo_rolling,
    demo_saga,
    doctor,
    external,
    instances,
    messages,
    operations,
    outbox,
    schedules,
    serve,
    tasks,
    tokens,
    worker,
)
from stepstone.cli.common import RootOptions, settings_options
from stepstone.errors import StepstoneError

__all__ = ["cli", "main"]

_COMMAND_MODULES: list[Any] = [
    db, doctor, instances, operations, worker, outbox, definitions, demo, bench, external, schedules, tasks,
    messages, serve, tokens,
]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@settings_options
@click.option("--app", default=None, metavar="MODULE:ATTR",
              help="The Registry (or Workflow) commands work with, e.g. myapp.flows:registry [env STEPSTONE_APP].")
@click.version_option(__version__, prog_name="stepstone")
@click.pass_context
def cli(ctx: click.Context, database_url: str | None, schema: str | None, app: str | None) -> None:
    """stepstone: durable workflows on PostgreSQL."""
    ctx.obj = RootOptions(database_url=database_url, schema=schema, app=app)


def _summarize(command: click.Command) -> None:
    """List a command by its whole first sentence (wrapped), never by one click cut at 45 characters."""
    if command.short_help is None and command.help:
        paragraph = inspect.cleandoc(command.help).split("\n\n")[0].replace("\n", " ")
        end = paragraph.find(". ")
        command.short_help = paragraph if end < 0 else paragraph[: end + 1]
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _summarize(sub)


db.db_group.add_command(operations.grant_command)
for _module in _COMMAND_MODULES:
    for _command in _module.commands:
        _summarize(_command)
        cli.add_command(_command)
demo.demo_command.add_command(demo_outbox.demo_outbox_command)
demo.demo_command.add_command(demo_fanout.demo_fanout_command)
demo.demo_command.add_command(demo_rolling.demo_rolling_command)
demo.demo_command.add_command(demo_saga.demo_saga_command)
demo.demo_command.add_command(demo_approval.demo_approval_command)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: exit 1 with one line for a StepstoneError, 2 for usage errors."""
    try:
        cli.main(args=argv, prog_name="stepstone")
    except StepstoneError as exc:  # safety net: commands normally convert these themselves
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
