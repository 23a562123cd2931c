"""``stepstone relay`` and ``stepstone outbox status | list | requeue | discard``: getting staged events out.

``stepstone relay --broker URL`` publishes until SIGTERM/SIGINT (it finishes the batch in hand, then
exits 0). ``stepstone worker`` runs the same relay beside the worker when a broker is configured
(``--broker``, env ``STEPSTONE_BROKER_URL`` or ``broker_url`` in ``[tool.stepstone]``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import click

from stepstone.cli.common import (
    EVENT_ID,
    FREE_TEXT,
    CliError,
    emit,
    output_option,
    render_table,
    run_async,
    with_settings,
)
from stepstone.cli.connection import open_store
from stepstone.config import Settings
from stepstone.core.bounds import MAX_BATCH
from stepstone.core.limits import MAX_INT4
from stepstone.errors import StepstoneError
from stepstone.outbox.publisher import open_publisher
from stepstone.outbox.relay import Relay, RelayConfig
from stepstone.store.database import redact_url
from stepstone.store.outbox import DeadLetter, PostgresOutbox
from stepstone.store.port import Store

__all__ = ["broker_option", "commands", "relay_beside", "relay_options"]

log = logging.getLogger("stepstone.cli.relay")
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def broker_option(func: Any) -> Any:
    return click.option(
        "--broker", default=None, metavar="URL",
        help="Publish the outbox here: redis://, nats://, amqp://, http(s):// (webhook) or memory:// "
             "[env STEPSTONE_BROKER_URL; pyproject broker_url]. See docs/outbox.md.")(func)


def relay_options(func: Any) -> Any:
    func = click.option("--relay-batch-size", "batch_size", type=click.IntRange(1, MAX_BATCH), default=500,
                        show_default=True, help="Events claimed and published per batch.")(func)
    return click.option("--max-attempts", type=click.IntRange(1, MAX_INT4), default=10, show_default=True,
                        help="Failed publishes of one event before it is dead-lettered.")(func)


def broker_of(settings: Settings, flag: str | None) -> str | None:
    """The broker URL of `--broker`, else the configured one. An empty flag is refused, as an empty
    --database-url is: `--broker "$UNSET"` turned the worker's relay off without a word."""
    if flag is not None and not flag.strip():
        raise CliError("--broker is empty: give a broker URL or leave the flag out (--no-relay turns it off)")
    return flag if flag is not None else settings.broker_url


@asynccontextmanager
async def relay_beside(store: Store, broker: str, config: RelayConfig) -> AsyncIterator[Relay]:
    """A relay on `store` publishing to `broker`, started on entry and stopped (batch finished) on exit."""
    try:
        publisher = open_publisher(broker)
    except StepstoneError as exc:
        raise CliError(str(exc)) from exc
    relay = Relay(PostgresOutbox(store), publisher, config)
    await relay.start()
    log.info("relay %s started: publishing to %s, batch %d, max attempts %d", config.relay_id, publisher.name,
             config.batch_size, config.max_attempts)
    try:
        yield relay
    finally:
        await relay.stop()
        await publisher.close()
        log.info("relay %s stopped: %d event(s) published", config.relay_id, relay.events.published)


async def _serve_relay(settings: Settings, broker: str, config: RelayConfig) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        async with open_store(settings, pool_size=3) as store, relay_beside(store, broker, config):
            log.info("database %s (schema %s)", redact_url(store.url), store.schema)
            await stop.wait()
    finally:
        for sig in _STOP_SIGNALS:
            loop.remove_signal_handler(sig)


@click.command("relay")
@broker_option
@relay_options
@with_settings
def relay_command(settings: Settings, broker: str | None, batch_size: int, max_attempts: int) -> None:
    """Publish staged events to a broker until SIGTERM/SIGINT (per-key order, at least once)."""
    from stepstone.cli.worker import configure_logging  # noqa: PLC0415 - avoid an import cycle at load

    url = broker_of(settings, broker)
    if not url:
        raise CliError("no broker configured: give --broker URL (or STEPSTONE_BROKER_URL)")
    configure_logging()
    run_async(_serve_relay(settings, url, RelayConfig(batch_size=batch_size, max_attempts=max_attempts)))


@click.group("outbox")
def outbox_group() -> None:
    """Inspect and repair the outbox: pending counts and lag, dead letters, requeue."""


async def _with_outbox(settings: Settings, action: Any) -> Any:
    async with open_store(settings, pool_size=2) as store:
        return await action(PostgresOutbox(store))


@outbox_group.command("status")
@with_settings
@output_option
def status_command(settings: Settings, output: str) -> None:
    """Pending, in-flight, backing-off, above-horizon and dead events, and the lag of the oldest pending
    and its last error (why the outbox waits)."""

    async def read(outbox: PostgresOutbox) -> dict[str, Any]:
        return await outbox.summary()

    status = run_async(_with_outbox(settings, read))

    def table() -> str:
        lag = status["lag_seconds"]
        rows = [[name, status[name]] for name in ("pending", "in_flight", "backing_off", "above_horizon", "dead",
                                                  "published", "discarded")]
        rows.append(["lag", "-" if lag is None else f"{lag:.3f} s"])
        if status["oldest_pending_error"]:
            rows.append(["oldest pending error", status["oldest_pending_error"]])
        return render_table(rows)

    emit(status, output, table)


@outbox_group.command("list")
@click.option("--dead", is_flag=True, help="Only dead-lettered events.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@with_settings
@output_option
def list_command(settings: Settings, dead: bool, limit: int, output: str) -> None:
    """Unpublished events, oldest first: why each waits (dead, behind a dead one, backing off, leased),
    in the states `outbox status` counts."""
    rows = run_async(_with_outbox(settings, lambda o: o.unpublished(dead=dead, limit=limit)))

    def why(r: DeadLetter) -> str:
        if r.state == "in_flight":
            return f"leased by {r.claimed_by} until {r.claimed_until:%H:%M:%S}"
        if r.state == "backing_off":
            return f"backing off until {r.next_attempt_at:%H:%M:%S}"
        if r.state != "dead" and r.behind_dead:
            return "behind a dead event of its key"
        return {"above_horizon": "above the visibility horizon"}.get(r.state, r.state)

    emit([r.as_dict() for r in rows], output, lambda: render_table(
        [[r.id, r.type, r.key or "", r.attempts, why(r), r.last_error or ""] for r in rows],
        ["id", "type", "key", "attempts", "state", "last error"]))


@outbox_group.command("requeue")
@click.argument("ids", nargs=-1, type=EVENT_ID)
@click.option("--all-dead", is_flag=True, help="Requeue every dead-lettered event.")
@with_settings
@output_option
def requeue_command(settings: Settings, ids: tuple[int, ...], all_dead: bool, output: str) -> None:
    """Put dead-lettered events back to pending (attempts reset); their keys resume in order."""
    if bool(ids) == all_dead:
        raise CliError("give event ids or --all-dead (not both)")
    done = run_async(_with_outbox(settings, lambda o: o.requeue(ids, all_dead=all_dead)))
    _report("requeued", ids, done, output)


@outbox_group.command("discard")
@click.argument("ids", nargs=-1, type=EVENT_ID)
@click.option("--all-dead", is_flag=True, help="Discard every dead-lettered event.")
@click.option("--reason", type=FREE_TEXT, required=True, help="Why (kept on each event).")
@with_settings
@output_option
def discard_command(settings: Settings, ids: tuple[int, ...], all_dead: bool, reason: str, output: str) -> None:
    """Give up on dead-lettered events for good: never published, out of the outbox, their keys resume.
    Use requeue instead to publish them after all."""
    if bool(ids) == all_dead:
        raise CliError("give event ids or --all-dead (not both)")
    if not reason.strip():
        raise CliError("--reason must not be empty")
    done = run_async(_with_outbox(settings, lambda o: o.discard(ids, all_dead=all_dead, reason=reason)))
    _report("discarded", ids, done, output)


def _report(verb: str, ids: tuple[int, ...], done: list[int], output: str) -> None:
    """What a requeue or discard did, a result per event as the API's requeue answers (`-o json`:
    ``{"matched", "results": [{"id", "result": VERB | "not_dead"}]}``); exit 1 when an id named was not dead."""
    missing = sorted(set(ids) - set(done))
    wanted = list(ids) if ids else sorted(done)
    results = [{"id": i, "result": verb if i in set(done) else "not_dead"} for i in wanted]
    emit({"matched": len(done), "results": results}, output,
         lambda: f"{verb} {len(done)} event(s)" + (f": {', '.join(map(str, done))}" if done else ""))
    if missing:
        raise CliError(f"not dead-lettered (or unknown): {', '.join(map(str, missing))}")


commands = [relay_command, outbox_group]
