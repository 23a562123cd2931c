"""A click group whose commands are imported when used: a command line loads its own command's module,
not every module of the CLI (the demos and their example workflows alone were 0.1 s of each start-up)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import click

__all__ = ["LazyGroup", "summarize"]


class LazyGroup(click.Group):
    """`lazy` maps a command's name to ``"module:attribute"`` (module relative to stepstone.cli)."""

    def __init__(self, *args: Any, lazy: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy and cmd_name not in self.commands:
            self.add_command(load(self.lazy[cmd_name]), cmd_name)
        return super().get_command(ctx, cmd_name)


def load(target: str) -> click.Command:
    module, _, attribute = target.partition(":")
    command = getattr(importlib.import_module(f"stepstone.cli.{module}"), attribute)
    if not isinstance(command, click.Command):
        raise TypeError(f"stepstone.cli.{target} is not a click command")
    summarize(command)
    return command


def summarize(command: click.Command) -> None:
    """List a command by its whole first sentence (wrapped), never by one click cut at 45 characters."""
    if command.short_help is None and command.help:
        paragraph = inspect.cleandoc(command.help).split("\n\n")[0].replace("\n", " ")
        end = paragraph.find(". ")
        command.short_help = paragraph if end < 0 else paragraph[: end + 1]
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            summarize(sub)
