# Generated from stepstone.client.Client by `python -m stepstone._gen_sync`: do not edit by hand.
# tests/test_sync_client.py fails when this file no longer matches Client.
"""The blocking face of `Client`: the same methods, run on a private event loop thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from stepstone.client import Client

if TYPE_CHECKING:
    from datetime import datetime

    from stepstone.authoring.workflow import Registry, Workflow
    from stepstone.client import InstanceInfo
    from stepstone.config import Settings
    from stepstone.core.limits import Limits

__all__ = ["SyncClient"]

T = TypeVar("T")


class SyncClient:
    """`Client`'s operations as blocking calls; open it like `Client.connect`, close it (or use `with`)."""

    def __init__(
        self,
        database_url: str | None = None,
        *,
        schema: str | None = None,
        registry: Registry | None = None,
        settings: Settings | None = None,
        limits: Limits | None = None,
        actor: str | None = None,
    ) -> None:
        """Connect to `database_url`, or to the configured (flags, environment, pyproject.toml) or
        embedded database. The schema must be migrated (`SchemaNotReady` otherwise), except on the
        embedded default, which is migrated here, saying so in one line on the log."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="stepstone-client", daemon=True)
        self._thread.start()
        try:
            self._client: Client = self._run(Client.connect(
                database_url,
                schema=schema,
                registry=registry,
                settings=settings,
                limits=limits,
                actor=actor,
            ))
        except BaseException:
            self._stop_loop()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    @property
    def client(self) -> Client:
        """The async `Client` underneath (its coroutines run on this object's loop thread only)."""
        return self._client

    def close(self) -> None:
        """Close the connection pool and stop the loop thread."""
        try:
            self._run(self._client.close())
        finally:
            self._stop_loop()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def detach(self, ) -> None:
        """Close what this client opened beside its store (the listener `wait_for` uses), leaving the
        store open: for a client made on a store its caller owns and closes."""
        self._run(self._client.detach())

    def start(
        self,
        workflow: Workflow[Any] | str,
        input: Any = None,  # noqa: A002 - the same name as Client's parameter
        *,
        idempotency_key: str | None = None,
        business_key: str | None = None,
        scope: str = "default",
    ) -> str:
        """Start an instance; returns its id. The same key with the same input returns the
        same instance; the same key with other input raises IdempotencyConflict. `scope` is the
        tenant the instance belongs to (the management API's tokens are granted per scope)."""
        return self._run(self._client.start(
            workflow,
            input,
            idempotency_key=idempotency_key,
            business_key=business_key,
            scope=scope,
        ))

    def signal(
        self,
        instance_id: str,
        name: str,
        payload: Any = None,
        *,
        dedup_key: str | None = None,
        position: str = "",
    ) -> int:
        """Send a signal; returns its command id. A repeated dedup key applies once. `position` addresses
        one branch (its path, e.g. ``ship/2``); the default is the instance's root position."""
        return self._run(self._client.signal(instance_id, name, payload, dedup_key=dedup_key, position=position))

    def cancel(self, instance_id: str, reason: str = "") -> str:
        """Cancel an instance (idempotent); returns its status afterwards."""
        return self._run(self._client.cancel(instance_id, reason))

    def retry(self, instance_id: str) -> None:
        """Re-drive the failed step of a FAILED instance."""
        self._run(self._client.retry(instance_id))

    def get(self, instance_id: str) -> InstanceInfo:
        """Where the instance is, what it holds and what it waits for."""
        return self._run(self._client.get(instance_id))

    def history(self, instance_id: str) -> list[dict[str, Any]]:
        """Every recorded event of the instance, oldest first."""
        return self._run(self._client.history(instance_id))

    def list(
        self,
        *,
        status: str | None = None,
        definition: str | None = None,
        business_key: str | None = None,
        after: tuple[datetime, str] | None = None,
        limit: int = 50,
    ) -> list[dict[str, Any]]:
        """Instances newest first; pass the last row's (created_at, id) as `after` for the next page."""
        return self._run(self._client.list(
            status=status,
            definition=definition,
            business_key=business_key,
            after=after,
            limit=limit,
        ))

    def wait_for(self, instance_id: str, timeout: float = 30.0) -> InstanceInfo:
        """Wait until the instance completes, fails or is cancelled; WaitTimeout otherwise.

        Wakes on the notification the instance sends when it settles (one LISTEN connection per
        client, shared by every wait), with a slow re-read in case a notification is lost."""
        return self._run(self._client.wait_for(instance_id, timeout))
