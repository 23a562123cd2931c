# Generated from stepstone.client.Client by `python -m stepstone._gen_sync`: do not edit by hand.
# tests/test_sync_client.py fails when this file no longer matches Client.
"""The blocking face of `MessageOperations` (`stepstone.client_messages`), mixed into `SyncClient`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstone._sync_loop import SyncLoop

if TYPE_CHECKING:
    from typing import Any

    from stepstone.authoring.workflow import Workflow
    from stepstone.client_messages import Published, SignalledOrStarted

__all__ = ["SyncMessageOperations"]


class SyncMessageOperations(SyncLoop):
    """`MessageOperations`'s operations as blocking calls."""

    def publish_message(
        self,
        name: str,
        correlation_key: str | bool | float,
        payload: Any = None,
        *,
        message_id: str | None = None,
        ttl: float | None = None,
        correlate_all: bool = False,
        connection: Any = None,
    ) -> Published:
        """Deliver a message to the oldest open subscription of (`name`, `correlation_key`), or to every
        one with `correlate_all`; buffer it for `ttl` seconds when none is open, else drop it. The same
        `message_id` with the same content answers as before; with other content, IdempotencyConflict.
        With `connection`, the message is written by the caller's own transaction (as `start`). A key that
        is not a string (a number, a boolean) is its JSON text (`true`, `42`), as a wait makes it of its state."""
        return self._run(self._client.publish_message(
            name,
            correlation_key,
            payload,
            message_id=message_id,
            ttl=ttl,
            correlate_all=correlate_all,
            connection=connection,
        ))

    def start_or_signal(
        self,
        workflow: Workflow[Any] | str,
        business_key: str,
        signal: str,
        payload: Any = None,
        *,
        input: Any = None,  # noqa: A002 - the same name as Client's parameter
        dedup_key: str | None = None,
        scope: str = "default",
    ) -> SignalledOrStarted:
        """Signal the instance of `workflow` with `business_key`, starting it with `input` first when
        none has the key, in one transaction: two concurrent calls start one instance and both signal it.
        `input` is checked only when it is needed: an instance that has the key is signalled without it.
        A signal sent before the instance reaches a wait that takes it waits (parked) until it does.
        `scope` is the scope key (tenant) the business key belongs to, and the new instance's scope."""
        return self._run(self._client.start_or_signal(
            workflow,
            business_key,
            signal,
            payload,
            input=input,
            dedup_key=dedup_key,
            scope=scope,
        ))
