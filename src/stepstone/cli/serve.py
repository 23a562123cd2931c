"""``stepstone serve``: the management API and the web UI, on 127.0.0.1:8080 by default.

Every request needs an API token (``stepstone tokens create``) unless ``--no-auth`` is given, which
is allowed on a loopback address only; a non-loopback ``--host`` is refused without a token to sign
in with. ``--read-only`` refuses every state-changing request with 405. docs/api.md, docs/ui.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import click

from stepstone.authoring.documents import Catalog
from stepstone.authoring.workflow import Registry
from stepstone.cli.addresses import host_port, http_url
from stepstone.cli.app import app_option
from stepstone.cli.common import CliError, listening_socket, run_async, with_settings
from stepstone.cli.connection import open_store
from stepstone.cli.http_server import quiet_server, stop_signals
from stepstone.config import Settings
from stepstone.errors import StepstoneError
from stepstone.store.database import redact_url
from stepstone.store.port import Store

__all__ = ["app_beside", "catalog_of", "check_no_auth", "commands", "serve_options"]

log = logging.getLogger("stepstone.cli.serve")


def _api_modules() -> Any:
    try:
        import uvicorn  # noqa: PLC0415 - an optional extra

        from stepstone.api import hosting  # noqa: PLC0415 - needs the extra too
        from stepstone.api.app import create_app  # noqa: PLC0415
        from stepstone.api.binding import check_bind  # noqa: PLC0415
    except ImportError as exc:
        raise CliError(f"stepstone serve needs the api extra: pip install 'stepstone[api]' ({exc.name} is missing)")\
            from None
    return uvicorn, hosting, create_app, check_bind


def _checked(check_bind: Any, host: str, *, auth: bool, active_tokens: int) -> None:
    try:
        check_bind(host, auth=auth, active_tokens=active_tokens)
    except StepstoneError as exc:
        raise CliError(str(exc)) from None


def check_no_auth(host: str, no_auth: bool) -> None:
    """Refuse --no-auth off loopback before anything connects."""
    if no_auth:
        _checked(_api_modules()[3], host, auth=False, active_tokens=0)


@asynccontextmanager
async def app_beside(store: Store, registry: Registry | None, host: str, port: int, *, read_only: bool,
                     no_auth: bool, catalog: Catalog | None = None) -> AsyncIterator[None]:
    """The API and UI served on `store` (the bind rule checked first) until the block ends."""
    uvicorn, hosting, create_app, check_bind = _api_modules()
    ctx = hosting.context_on(store, registry=registry, read_only=read_only,
                             authenticate=hosting.NO_AUTH if no_auth else None, catalog=catalog)
    try:
        tokens = await ctx.management.active_token_count()
        _checked(check_bind, host, auth=not no_auth, active_tokens=tokens)
        # Bound here, not by uvicorn, which exits the process (SystemExit, a traceback) when it cannot bind.
        with listening_socket(host, port) as sock:
            port = sock.getsockname()[1]  # --port 0 picks one: say which
            # log_config=None: uvicorn's lines go through the process's logging (the worker's --log-format),
            # not handlers of its own that print text beside the worker's JSON lines.
            config = uvicorn.Config(create_app(ctx), log_level="warning", lifespan="off", log_config=None,
                                    timeout_graceful_shutdown=5)  # live-update streams end with it
            server = quiet_server(uvicorn, config)
            task = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started:
                if task.done():  # it stopped before it served: say why in one line
                    exc = task.exception()
                    raise CliError(f"cannot serve on {host_port(host, port)}: {exc or 'the server stopped'}")
                await asyncio.sleep(0.02)
            mode = "no authentication (loopback only)" if no_auth else f"API tokens ({tokens} active)"
            log.info("serving %s (API %s, %s%s); database %s (schema %s)", http_url(host, port, "/ui/"),
                     http_url(host, port, "/api/v1"), mode, ", read-only" if read_only else "",
                     redact_url(store.url), store.schema)
            if not no_auth and tokens == 0:
                log.warning("no API token exists yet: create one with `stepstone tokens create --role admin`")
            try:
                yield
            finally:
                server.should_exit = True
                await task
    finally:
        await ctx.close()


async def _serve(settings: Settings, registry: Registry | None, host: str, port: int, read_only: bool,
                 no_auth: bool, catalog: Catalog | None) -> None:
    check_no_auth(host, no_auth)
    async with (stop_signals() as stop, open_store(settings, pool_size=10) as store,
                app_beside(store, registry, host, port, read_only=read_only, no_auth=no_auth, catalog=catalog)):
        await stop.wait()


def serve_options(func: Any) -> Any:
    """--host, --port, --read-only, --no-auth, --catalog (for `serve`, and `worker --serve`)."""
    func = click.option("--catalog", default=None, metavar="MODULE:ATTR",
                        help="The Catalog of handlers workflow documents may name: POST /definitions/validate "
                             "checks against it, POST /definitions/publish binds with it.")(func)
    func = click.option("--no-auth", is_flag=True,
                        help="No tokens: every request is the local admin (loopback only).")(func)
    func = click.option("--read-only", is_flag=True, help="Refuse every state-changing request (HTTP 405).")(func)
    func = click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)(func)
    return click.option("--host", default="127.0.0.1", show_default=True,
                        help="Address to listen on; a non-loopback one needs an API token to exist.")(func)


@click.command("serve")
@serve_options
@app_option(required=False)
@with_settings
def serve_command(
    settings: Settings, registry: Registry | None, host: str, port: int, read_only: bool, no_auth: bool,
    catalog: str | None,
) -> None:
    """Serve the management API and the web UI until SIGTERM/SIGINT.

    Starting instances from the API or UI needs --app (the workflows to start); publishing a workflow
    document that names handlers needs --catalog; everything else works on any instance in the database."""
    from stepstone.cli.worker import configure_logging  # noqa: PLC0415 - worker imports this module

    configure_logging()
    run_async(_serve(settings, registry, host, port, read_only, no_auth, catalog_of(catalog)))


def catalog_of(spec: str | None) -> Catalog | None:
    """The Catalog `--catalog MODULE:ATTR` names, or None without one."""
    if spec is None:
        return None
    from stepstone.cli.definitions import load_catalog  # noqa: PLC0415 - only when asked

    return load_catalog(spec)


commands = [serve_command]
