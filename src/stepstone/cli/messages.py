"""``stepstone messages publish``: publish a correlated message (docs/tasks.md, "Messages")."""

from __future__ import annotations

from dataclasses import asdict

import click

from stepstone.cli.common import TEXT, Finite, emit, output_option, with_settings
from stepstone.cli.instances import _jsonable, _time, _with_client, parse_json
from stepstone.client_messages import Published
from stepstone.config import Settings

__all__ = ["commands"]


@click.group("messages")
def messages_group() -> None:
    """Correlated messages: publish one to the waits subscribed to its name and key."""


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
@click.option("--ttl", type=Finite(0), metavar="SECONDS",
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


commands = [messages_group]
