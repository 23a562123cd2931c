"""``stepstone messages publish | start-or-signal``: publish a correlated message, signal a business key's
instance and start it first when there is none (docs/messages.md)."""

from __future__ import annotations

from dataclasses import asdict

import click

from stepstone.authoring.workflow import Registry
from stepstone.cli.app import app_option
from stepstone.cli.common import TEXT, Duration, emit, output_option, with_settings
from stepstone.cli.instances import _jsonable, _time, _with_client, parse_json
from stepstone.client_messages import Published
from stepstone.config import Settings
from stepstone.core.pin import DEFAULT_SCOPE

__all__ = ["commands"]


@click.group("messages")
def messages_group() -> None:
    """Correlated messages and signal-with-start: publish one to the waits subscribed to its name and key."""


def _describe(name: str, published: Published) -> str:
    if published.outcome == "delivered":
        where = ", ".join(d.instance_id + (f" ({d.position})" if d.position else "") for d in published.deliveries)
        text = f"message {name} delivered to {where}"
    elif published.outcome == "buffered":
        text = f"message {name} buffered until {_time(published.expires_at)}"
    else:
        text = f"message {name} dropped: no open subscription and no --ttl"
    return text + (" (repeated message id: the earlier answer)" if published.duplicate else "")


@messages_group.command("publish")
@click.argument("name", type=TEXT)
@click.argument("correlation_key", type=TEXT)
@click.option("--payload", metavar="JSON", help="The message's payload as JSON.")
@click.option("--message-id", type=TEXT, metavar="ID", help="Publishing again with the same id delivers once.")
@click.option("--ttl", type=Duration(),
              help="Keep it this long when no subscription is open.")
@click.option("--all", "correlate_all", is_flag=True, help="Deliver to every open subscription, not the oldest.")
@output_option
@with_settings
def publish_command(settings: Settings, output: str, name: str, correlation_key: str, payload: str | None,
                    message_id: str | None, ttl: float | None, correlate_all: bool) -> None:
    """Publish message NAME for CORRELATION_KEY: delivered, buffered or dropped, as it says."""
    data = parse_json(payload, "--payload") if payload is not None else None
    published = _with_client(settings, None, lambda c: c.publish_message(
        name, correlation_key, data, message_id=message_id, ttl=ttl, correlate_all=correlate_all))
    emit(_jsonable(asdict(published)), output, lambda: _describe(name, published))


@messages_group.command("start-or-signal")
@click.argument("workflow", type=TEXT)
@click.argument("business_key", type=TEXT)
@click.argument("signal", type=TEXT)
@click.option("--payload", metavar="JSON", help="The signal's payload as JSON.")
@click.option("--input", "input_text", metavar="JSON", help="The instance's input, used only when this starts it.")
@click.option("--dedup-key", type=TEXT, metavar="K", help="Sending again with the same key signals once.")
@click.option("--scope", type=TEXT, default=DEFAULT_SCOPE, show_default=True,
              help="The scope (tenant key) the business key belongs to, and the new instance's.")
@app_option(required=True)
@output_option
@with_settings
def start_or_signal_command(settings: Settings, registry: Registry, output: str, workflow: str, business_key: str,
                            signal: str, payload: str | None, input_text: str | None, dedup_key: str | None,
                            scope: str) -> None:
    """Signal SIGNAL to the instance of WORKFLOW with BUSINESS_KEY, starting it with --input first when none
    has the key, in one transaction (Client.start_or_signal, POST /start-or-signal)."""
    data = parse_json(payload, "--payload") if payload is not None else None
    state = parse_json(input_text, "--input") if input_text is not None else None
    done = _with_client(settings, registry, lambda c: c.start_or_signal(
        workflow, business_key, signal, data, input=state, dedup_key=dedup_key, scope=scope))
    emit({**asdict(done), "scope": scope}, output,
         lambda: f"{'started and signalled' if done.started else 'signalled'} instance {done.instance_id} "
                 f"({signal}, command {done.command_id})")


commands = [messages_group]
