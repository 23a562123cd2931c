"""The ``stepstone`` command line: the root group and where each command lives.

To add commands, write a module in this package exposing ``commands`` (a list of click commands or
groups) and name each of them in ``COMMANDS`` (tests/test_cli_surface.py checks the two agree). A
command's module is imported only when that command runs or ``--help`` lists it.
"""

from __future__ import annotations

import sys

import click

from stepstone import __version__
from stepstone.cli.common import Interrupted, RootOptions, settings_options
from stepstone.cli.lazy import LazyGroup
from stepstone.errors import StepstoneError

__all__ = ["COMMANDS", "cli", "main"]

# name -> "module:attribute" in this package
COMMANDS = {
    "bench": "bench:bench_command",
    "cancel": "instances:cancel_command",
    "db": "db:db_group",
    "definitions": "definitions:definitions_group",
    "demo": "demo:demo_command",
    "doctor": "doctor:doctor_command",
    "external": "external:external_group",
    "find": "operations:find_command",
    "history": "operations:history_command",
    "inspect": "operations:inspect_command",
    "limits": "schedules:limits_group",
    "list": "operations:list_command",
    "messages": "messages:messages_group",
    "outbox": "outbox:outbox_group",
    "probe": "operations:probe_command",
    "relay": "outbox:relay_command",
    "repair": "operations:repair_group",
    "replay": "operations:replay_command",
    "retention": "operations:retention_group",
    "retry": "instances:retry_command",
    "schedules": "schedules:schedules_group",
    "serve": "serve:serve_command",
    "show": "instances:show_command",
    "signal": "instances:signal_command",
    "start": "instances:start_command",
    "stuck": "operations:stuck_command",
    "tasks": "tasks:tasks_group",
    "tokens": "tokens:tokens_group",
    "worker": "worker:worker_command",
}


class _Root(LazyGroup):
    """The root group: Ctrl-C on any command, one that runs synchronously too (`db sql`, `definitions
    validate`), is ``error: interrupted`` and 130, as `run_async` makes it for the asynchronous ones,
    not click's "Aborted!" and 1."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted("interrupted") from None


@click.group(cls=_Root, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@settings_options
@click.option("--app", default=None, metavar="MODULE:ATTR",
              help="The Registry (or Workflow) commands work with, e.g. myapp.flows:registry [env STEPSTONE_APP].")
@click.version_option(__version__, prog_name="stepstone")
@click.pass_context
def cli(ctx: click.Context, database_url: str | None, schema: str | None, app: str | None) -> None:
    """stepstone: durable workflows on PostgreSQL."""
    ctx.obj = RootOptions(database_url=database_url, schema=schema, app=app)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: exit 1 with one line for a StepstoneError, 2 for usage errors."""
    try:
        cli.main(args=argv, prog_name="stepstone")
    except StepstoneError as exc:  # safety net: commands normally convert these themselves
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
