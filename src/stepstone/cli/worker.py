"""``stepstone worker``: run the workflows of ``--app`` until SIGTERM or SIGINT.

The first signal drains: the worker stops claiming, lets in-flight steps finish up to the drain
timeout, gives back the claims it still holds (another worker picks them up at once) and exits 0.
A second signal exits at once with 128 + the signal number; leases then expire on their own.
With a broker configured (``--broker``, ``STEPSTONE_BROKER_URL``, ``broker_url``) the outbox relay runs
beside the worker and stops after it (docs/outbox.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import click

from stepstone.authoring.workflow import Registry
from stepstone.cli.addresses import host_port, http_url, one_port_clashes
from stepstone.cli.app import app_option
from stepstone.cli.common import CliError, Duration, run_async, with_settings
from stepstone.cli.connection import open_store
from stepstone.cli.outbox import broker_of, broker_option, relay_beside, relay_options
from stepstone.cli.serve import catalog_of, check_no_auth, serve_options
from stepstone.config import Settings
from stepstone.ops import Operations
from stepstone.ops.retention import MIN_INTERVAL, RetentionLoop
from stepstone.outbox.relay import RelayConfig
from stepstone.runtime.worker import Worker, WorkerConfig
from stepstone.runtime.worker_config import MAX_CONCURRENCY
from stepstone.store.database import redact_url
from stepstone.store.observing import ObservingStore

__all__ = ["commands", "configure_logging", "health_beside"]

if TYPE_CHECKING:
    from stepstone.observability.health import HealthServer

log = logging.getLogger("stepstone.cli.worker")
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def configure_logging(log_format: str = "text") -> None:
    """Log lines on stderr at INFO and above, stepstone's and the application's alike (a handler on the root
    logger, once per process); `json`: one object per line (docs/observability.md). An application that set
    up logging itself (the root logger has a handler once --app is imported) keeps its own set-up."""
    root = logging.getLogger()
    if root.handlers:
        return
    from stepstone.observability.logs import JsonFormatter, TextFormatter  # noqa: PLC0415 - the worker's only

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    # httpx (the webhook publisher) logs every request at INFO: one line per published event.
    if logging.getLogger("httpx").level == logging.NOTSET:
        logging.getLogger("httpx").setLevel(logging.WARNING)


def _force_exit(signum: int) -> None:
    log.warning("second %s: exiting now without draining; held leases will expire",
                signal.Signals(signum).name)
    sys.stderr.flush()
    os._exit(128 + signum)


async def serve(
    settings: Settings, registry: Registry, config: WorkerConfig, relay: tuple[str, RelayConfig] | None = None,
    retention_every: float | None = None,
    metrics_port: int | None = None, metrics_host: str = "0.0.0.0",  # noqa: S104 - probes come from outside
    web: dict[str, Any] | None = None,
) -> int:
    """Run a worker (and the relay to `relay`'s broker) until the first stop signal, then drain; returns the
    number of claims released."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[int] = []

    def on_signal(signum: int) -> None:
        if received:
            _force_exit(signum)
        received.append(signum)
        stop.set()

    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    pool_size = config.concurrency + 2 + (2 if relay else 0) + (4 if web else 0)
    try:
        async with (open_store(settings, pool_size=pool_size) as store,
                    contextlib.AsyncExitStack() as beside):
            if relay is not None:
                await beside.enter_async_context(relay_beside(store, *relay))
            if retention_every is not None:  # opt-in; the advisory lock lets one replica's sweep through
                sweeper = RetentionLoop(Operations.on(store).store, retention_every)
                await sweeper.start()
                beside.push_async_callback(sweeper.stop)
            if web is not None:  # the management API and UI in this process (`--serve`)
                from stepstone.cli.serve import app_beside  # noqa: PLC0415 - the api extra, only when asked

                await beside.enter_async_context(app_beside(store, registry, **web))
            worker = Worker(store, registry, config)
            await worker.start()
            if metrics_port is not None:
                try:
                    await beside.enter_async_context(health_beside(worker, store, metrics_host, metrics_port))
                except CliError:  # an address it cannot listen on: stop the worker before the store closes
                    await worker.stop()
                    raise
            workflows = ", ".join(f"{wf.id} v{wf.version}" for wf in registry)
            log.info("worker %s started: concurrency %d, database %s (schema %s), workflows %s",
                     config.worker_id, config.concurrency, redact_url(store.url), store.schema, workflows)
            await stop.wait()
            await worker.stop_claiming()
            log.info("%s received: draining %d in-flight step(s) for up to %g s (a second signal exits at once)",
                     signal.Signals(received[0]).name, worker.in_flight, config.drain_timeout)
            released_before = worker.events.released
            abandoned = await worker.stop()
            released = worker.events.released - released_before
            if abandoned:
                log.info("%d synchronous handler thread(s) abandoned; exiting without waiting for them", abandoned)
            log.info("worker %s drained: %d claim(s) released; exiting", config.worker_id, released)
            return released
    finally:
        for sig in _STOP_SIGNALS:
            loop.remove_signal_handler(sig)


@contextlib.asynccontextmanager
async def health_beside(worker: Worker, store: object, host: str, port: int) -> AsyncIterator[HealthServer]:
    """The probes and metrics port beside a running worker; metrics when the prometheus extra is installed."""
    from stepstone.observability.health import HealthServer  # noqa: PLC0415

    metrics = None
    try:
        from stepstone.observability.metrics import WorkerMetrics  # noqa: PLC0415

        metrics = WorkerMetrics().install()
    except ImportError:
        log.info("prometheus_client is not installed: /metrics answers 404 (pip install 'stepstone[prometheus]')")
    assert isinstance(store, ObservingStore)
    server = HealthServer(worker, store, host=host, port=port, metrics=metrics)
    try:
        await server.start()
    except OSError as exc:  # an address that does not resolve, a port in use or not ours to take
        if metrics is not None:
            metrics.uninstall()
        reason = exc.strerror or exc
        raise CliError(f"cannot listen on {host_port(host, port)} for health and metrics: {reason}") from None
    log.info("health and metrics on %s (/livez, /readyz, /metrics)", http_url(host, server.port))
    try:
        yield server
    finally:
        await server.stop()
        if metrics is not None:
            metrics.uninstall()


@click.command("worker")
@app_option(required=True)
@click.option("--concurrency", type=click.IntRange(1, MAX_CONCURRENCY), default=8, show_default=True,
              help="Steps run at the same time.")
@click.option("--lease-seconds", type=Duration(1.0), default=30.0, show_default=True,
              help="How long a claim lasts without renewal (renewed every third of it).")
@click.option("--poll-interval", type=Duration(0.01), default=1.0, show_default=True,
              help="Longest pause between looks for work when no notification arrives.")
@click.option("--drain-timeout", type=Duration(), default=10.0, show_default=True,
              help="On SIGTERM/SIGINT, how long in-flight steps may take to finish.")
@click.option("--heartbeat-seconds", type=Duration(0.05), default=10.0, show_default=True,
              help="How often the worker records which pins it serves (the stranded report reads it).")
@broker_option
@click.option("--no-relay", is_flag=True, help="Do not run the outbox relay here even when a broker is configured.")
@relay_options
@click.option("--retention-every", type=Duration(MIN_INTERVAL), default=None,
              help="Also run retention this often, e.g. 1h (one replica at a time; docs/operations.md).  "
                   f"[x>={MIN_INTERVAL:g}s]")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
              help="Serve /livez, /readyz and /metrics (Prometheus) on this port.")
@click.option("--metrics-host", default="0.0.0.0", show_default=True, help="The address --metrics-port binds.")  # noqa: S104
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="json: one object per line, with instance, position, step and attempt.")
@click.option("--serve", "serve_web", is_flag=True,
              help="Also serve the management API and UI here (as `stepstone serve` does; needs the api extra).")
@serve_options
@with_settings
def worker_command(
    settings: Settings, registry: Registry, concurrency: int, lease_seconds: float, poll_interval: float,
    drain_timeout: float, heartbeat_seconds: float, broker: str | None, no_relay: bool, batch_size: int,
    max_attempts: int, retention_every: float | None, metrics_port: int | None, metrics_host: str, log_format: str,
    serve_web: bool, host: str, port: int, read_only: bool, no_auth: bool, catalog: str | None,
) -> None:
    """Run the workflows of --app until SIGTERM/SIGINT.

    A configured database must be migrated first (`stepstone db migrate`); the embedded default is
    migrated on start, in one line on stderr. With a broker configured, the outbox relay runs beside
    the worker (--no-relay turns it off)."""
    configure_logging(log_format)
    config = WorkerConfig(concurrency=concurrency, lease_seconds=lease_seconds, poll_interval=poll_interval,
                          drain_timeout=drain_timeout, heartbeat_seconds=heartbeat_seconds)
    # A synchronous handler still running past the drain timeout is abandoned by `Worker.stop`
    # (its claim released, a warning logged); its daemon thread does not hold up the exit.
    url = None if no_relay else broker_of(settings, broker)
    relay = (url, RelayConfig(batch_size=batch_size, max_attempts=max_attempts)) if url else None
    if not serve_web:
        _refuse_serve_options_alone()
    web = None
    if serve_web:
        # The API would take the port and the probes fail after it started; on two addresses both can have it.
        if port and metrics_port == port and one_port_clashes(host, metrics_host):
            raise click.BadParameter(f"{port} is --port too, on {metrics_host} and {host}: the API and UI and the "
                                     "probes and metrics need two ports, or two addresses",
                                     param_hint="'--metrics-port'")
        check_no_auth(host, no_auth)
        web = {"host": host, "port": port, "read_only": read_only, "no_auth": no_auth, "catalog": catalog_of(catalog)}
    run_async(serve(settings, registry, config, relay, retention_every, metrics_port, metrics_host, web))


_SERVE_ONLY = {"catalog": "--catalog", "host": "--host", "port": "--port", "read_only": "--read-only",
               "no_auth": "--no-auth"}
_PROBES = {"host": " (the probes and metrics listen on --metrics-host)",
           "port": " (the probes and metrics listen on --metrics-port)"}


def _refuse_serve_options_alone() -> None:
    """An option of the management API given without --serve, which alone starts it, was silently ignored
    (a --catalog the operator expected document publishing to bind with, say): refused, naming the fix."""
    ctx = click.get_current_context()
    for name, flag in _SERVE_ONLY.items():
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE:
            raise click.BadParameter(
                f"it is an option of the management API and UI, which this worker serves only with --serve: "
                f"pass --serve too, or leave {flag} out{_PROBES.get(name, '')}", param_hint=f"'{flag}'")


commands = [worker_command]
