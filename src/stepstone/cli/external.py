"""``stepstone external serve | list``: external tasks for workers in any language.

``stepstone external serve`` runs the HTTP endpoint (`stepstone.external.http`, extra
``stepstone[external]``) until SIGTERM/SIGINT; ``stepstone external list`` shows tasks.
"""

from __future__ import annotations

import asyncio
import logging
import os

import click

from stepstone import cursors
from stepstone.cli.addresses import http_url
from stepstone.cli.common import (
    TEXT,
    CliError,
    emit,
    listening_socket,
    output_option,
    render_table,
    run_async,
    with_settings,
)
from stepstone.cli.connection import open_store
from stepstone.cli.http_server import quiet_server, stop_signals
from stepstone.config import Settings
from stepstone.errors import InvalidInput
from stepstone.external.tasks import STATUSES, ExternalTasks, TaskPage

__all__ = ["commands"]

TOKEN_ENV = "STEPSTONE_EXTERNAL_TOKEN"  # noqa: S105 - the name of the variable, not a secret
log = logging.getLogger("stepstone.cli.external")


@click.group("external")
def external_group() -> None:
    """External tasks: serve them over HTTP to workers in any language, list them."""


async def _serve(settings: Settings, host: str, port: int, token: str | None) -> None:
    try:
        import uvicorn  # noqa: PLC0415 - an optional extra

        from stepstone.external.http import create_app  # noqa: PLC0415 - needs the same extra
    except ImportError as exc:
        raise CliError(f"stepstone external serve needs {exc.name}: pip install 'stepstone[external]'") from exc
    async with stop_signals() as stop, open_store(settings, pool_size=10) as store:
        sock = listening_socket(host, port)
        tasks = ExternalTasks(store)
        try:
            config = uvicorn.Config(create_app(tasks, token=token), log_level="warning", lifespan="off",
                                    timeout_graceful_shutdown=5)  # a long poll in hand ends with it
            server = quiet_server(uvicorn, config)
            bound_host, bound_port = sock.getsockname()[:2]
            log.info("external tasks on %s (%s)", http_url(bound_host, bound_port),
                     "bearer token required" if token else "no token: bind to a trusted network only")
            serving, stopped = asyncio.create_task(server.serve(sockets=[sock])), asyncio.create_task(stop.wait())
            try:
                await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopped.cancel()
            server.should_exit = True
            await serving
            log.info("external tasks on %s stopped", http_url(bound_host, bound_port))
        finally:
            sock.close()
            await tasks.close()


@external_group.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8470, show_default=True)
@click.option("--token", default=None, metavar="SECRET",
              help=f"Require 'Authorization: Bearer SECRET' on every request [env {TOKEN_ENV}].")
@with_settings
def serve_command(settings: Settings, host: str, port: int, token: str | None) -> None:
    """Serve fetch-and-lock, extend, complete, failure and business error over HTTP until SIGTERM/SIGINT."""
    from stepstone.cli.worker import configure_logging  # noqa: PLC0415 - avoid an import cycle at load

    configure_logging()
    run_async(_serve(settings, host, port, token or os.environ.get(TOKEN_ENV) or None))


@external_group.command("list")
@click.option("--topic", type=TEXT, default=None)
@click.option("--status", type=click.Choice(STATUSES, case_sensitive=False), default=None)
@click.option("--instance", "instance_id", type=TEXT, default=None, metavar="ID")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@click.option("--after", type=TEXT, default=None, metavar="CURSOR",
              help="Continue after the page that printed this cursor.")
@with_settings
@output_option
def list_command(settings: Settings, topic: str | None, status: str | None, instance_id: str | None, limit: int,
                 after: str | None, output: str) -> None:
    """External tasks oldest first, a page at a time: topic, status, who holds the lock, retries left, last error."""
    if after:  # a bad cursor is refused before connecting, as every CLI argument is
        _check_cursor(after)

    async def read() -> TaskPage:
        async with open_store(settings, pool_size=2) as store:
            return await ExternalTasks(store).page(topic=topic, status=status, instance_id=instance_id, limit=limit,
                                                   after=after, what="--after")

    found = run_async(read())
    emit({"tasks": found.tasks, "next_cursor": found.next_cursor}, output, lambda: render_table(
        [[t["id"], t["topic"], t["status"], t["instance_id"], t["position"] or "-", t["lock_owner"] or "",
          t["retries"], t["last_error"] or ""] for t in found.tasks],
        ["id", "topic", "status", "instance", "position", "locked by", "retries", "last error"])
        + (f"\nnext page: --after {found.next_cursor}" if found.next_cursor else ""))


def _check_cursor(after: str) -> None:
    try:
        cursors.decode(after, cursors.INSTANT, cursors.UUID, what="--after")
    except InvalidInput:
        raise CliError(f"--after {after!r} is not a cursor printed by `stepstone external list`") from None


commands = [external_group]
