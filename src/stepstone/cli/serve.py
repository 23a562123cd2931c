"""``stepstone serve``: the management API and the web UI, on 127.0.0.1:8080 by default.

Every request needs an API token (``stepstone tokens create``) unless ``--no-auth`` is given, which
is allowed on a loopback address only; a non-loopback ``--host`` is refused without a token to sign
in with. ``--read-only`` refuses every state-changing request with 405. docs/api.md, docs/ui.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from typing import Any

import click

from stepstone.authoring.workflow import Registry
from stepstone.cli.app import app_option
from stepstone.cli.common import CliError, run_async, with_settings
from stepstone.cli.connection import open_store
from stepstone.cli.worker import configure_logging
from stepstone.config import Settings
from stepstone.errors import StepstoneError
from stepstone.store.database import redact_url

__all__ = ["commands"]

log = logging.getLogger("stepstone.cli.serve")
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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


def _quiet_server(uvicorn: Any, config: Any) -> Any:
    """A uvicorn server that stops on SIGTERM/SIGINT and returns (exit 0), instead of re-raising the
    signal after its graceful shutdown as uvicorn does."""

    class Server(uvicorn.Server):  # type: ignore[misc]
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            loop = asyncio.get_running_loop()
            for sig in _STOP_SIGNALS:
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
            try:
                yield
            finally:
                for sig in _STOP_SIGNALS:
                    loop.remove_signal_handler(sig)

    return Server(config)


def _checked(check_bind: Any, host: str, *, auth: bool, active_tokens: int) -> None:
    try:
        check_bind(host, auth=auth, active_tokens=active_tokens)
    except StepstoneError as exc:
        raise CliError(str(exc)) from None


async def _serve(settings: Settings, registry: Registry | None, host: str, port: int, read_only: bool,
                 no_auth: bool) -> None:
    uvicorn, hosting, create_app, check_bind = _api_modules()
    if no_auth:  # refused before anything connects
        _checked(check_bind, host, auth=False, active_tokens=0)
    async with open_store(settings, pool_size=10) as store:
        ctx = hosting.context_on(store, registry=registry, read_only=read_only,
                                 authenticate=hosting.NO_AUTH if no_auth else None)
        try:
            tokens = await ctx.management.active_token_count()
            _checked(check_bind, host, auth=not no_auth, active_tokens=tokens)
            app = create_app(ctx)
            mode = "no authentication (loopback only)" if no_auth else f"API tokens ({tokens} active)"
            log.info("serving http://%s:%d/ui/ (API %s/api/v1, %s%s); database %s (schema %s)", host, port,
                     f"http://{host}:{port}", mode, ", read-only" if read_only else "", redact_url(store.url),
                     store.schema)
            if not no_auth and tokens == 0:
                log.warning("no API token exists yet: create one with `stepstone tokens create --role admin`")
            config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
            await _quiet_server(uvicorn, config).serve()
        finally:
            await ctx.close()


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; a non-loopback one needs an API token to exist.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--read-only", is_flag=True, help="Refuse every state-changing request (HTTP 405).")
@click.option("--no-auth", is_flag=True, help="No tokens: every request is the local admin (loopback only).")
@app_option(required=False)
@with_settings
def serve_command(
    settings: Settings, registry: Registry | None, host: str, port: int, read_only: bool, no_auth: bool,
) -> None:
    """Serve the management API and the web UI until SIGTERM/SIGINT.

    Starting instances from the API or UI needs --app (the workflows to start); everything else works
    on any instance in the database."""
    configure_logging()
    run_async(_serve(settings, registry, host, port, read_only, no_auth))


commands = [serve_command]
