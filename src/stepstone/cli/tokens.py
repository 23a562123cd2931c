"""``stepstone tokens create | list | revoke``: API tokens of the management API and UI.

A token is printed once, by ``create``; only its SHA-256 is stored. Roles, weakest first: viewer,
task_worker, operator, admin; each token holds one role in one scope (``--scope '*'``: every scope).
"""

from __future__ import annotations

import getpass
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click

from stepstone.cli.common import TEXT, CliError, emit, output_option, render_table, run_async, with_settings
from stepstone.cli.connection import open_store
from stepstone.config import Settings
from stepstone.store.management import open_management
from stepstone.store.management_port import ROLES, ManagementStore

__all__ = ["commands"]

T = TypeVar("T")


def _with_management(settings: Settings, work: Callable[[ManagementStore], Awaitable[T]]) -> T:
    async def go() -> T:
        async with open_store(settings, pool_size=1) as store:
            return await work(open_management(store))

    return run_async(go())


def _tokens() -> Any:
    try:
        from stepstone.api import tokens  # noqa: PLC0415 - an optional extra
    except ImportError as exc:
        raise CliError(f"stepstone tokens needs the api extra: pip install 'stepstone[api]' ({exc.name} is missing)")\
            from None
    return tokens


@click.group("tokens")
def tokens_group() -> None:
    """Create, list and revoke API tokens of `stepstone serve`."""


@tokens_group.command("create")
@click.option("--role", type=click.Choice(ROLES), required=True, help="What the token may do.")
@click.option("--scope", type=TEXT, default="*", show_default=True, help="The scope (tenant) it works in; * for all.")
@click.option("--name", type=TEXT, default=None, help="A label, recorded as the actor token:NAME.")
@click.option("--group", "groups", multiple=True, type=TEXT,
              help="A group its user belongs to (repeatable): the task inbox offers it that group's tasks.")
@output_option
@with_settings
def create_command(settings: Settings, output: str, role: str, scope: str, name: str | None,
                   groups: tuple[str, ...]) -> None:
    """Create a token and print it (once: only its hash is stored)."""
    tokens = _tokens()
    token, record = _with_management(settings, lambda m: tokens.create_token(
        m, role=role, scope=scope, name=name, created_by=f"cli:{getpass.getuser()}", groups=groups))
    emit({"token": token, **record.as_dict()}, output, lambda: token)
    if output != "json":
        click.echo(f"token {record.name} ({record.id}): role {role} in scope {scope}; it is shown only now",
                   err=True)


@tokens_group.command("list")
@click.option("--all", "include_revoked", is_flag=True, help="Include revoked tokens.")
@output_option
@with_settings
def list_command(settings: Settings, output: str, include_revoked: bool) -> None:
    """List tokens (never the tokens themselves): id, name, role, scope, groups, created, revoked."""
    tokens = _tokens()
    rows = _with_management(settings, lambda m: tokens.list_tokens(m, include_revoked=include_revoked))
    emit([r.as_dict() for r in rows], output, lambda: render_table(
        [[r.id, r.name, r.role, r.scope, ", ".join(r.groups), f"{r.created_at:%Y-%m-%d %H:%M}" if r.created_at else "",
          f"{r.revoked_at:%Y-%m-%d %H:%M}" if r.revoked_at else ""] for r in rows],
        ["id", "name", "role", "scope", "groups", "created", "revoked"]) if rows else "no tokens")


@tokens_group.command("revoke")
@click.argument("token_id")
@output_option
@with_settings
def revoke_command(settings: Settings, output: str, token_id: str) -> None:
    """Revoke a token by its id (from `tokens list`); requests with it get 401 from then on."""
    tokens = _tokens()
    record = _with_management(settings, lambda m: tokens.revoke_token(m, token_id))
    emit(record.as_dict(), output, lambda: f"revoked {record.name} ({record.id})")


commands = [tokens_group]
