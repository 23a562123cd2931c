"""The adapter's Listener: closing a wake-up connection that is already gone is not an error.

The worker used to catch the driver's exception itself; the port's `Listener.close` now owns it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from stepstone.store.factory import open_store
from stepstone.store.postgres import Listener


class _CutConnection:
    """A connection whose UNLISTEN fails as a cut one does; records that it was terminated."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.terminated = False

    async def remove_listener(self, *_: Any) -> None:
        raise self.error

    async def close(self) -> None:
        raise AssertionError("a cut connection is terminated, not closed")

    def terminate(self) -> None:
        self.terminated = True

    def is_closed(self) -> bool:
        return self.terminated


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.InterfaceError("cannot call Connection.fetch(): connection is closed"),
        asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        ConnectionResetError("reset by peer"),
        asyncpg.exceptions.InternalClientError("cannot switch to state 11; another operation (2) is in progress"),
    ],
)
async def test_close_of_a_cut_connection_does_not_raise(error: Exception) -> None:
    conn = _CutConnection(error)
    listener = Listener(conn, "stepstone_x", lambda *_: None)  # type: ignore[arg-type]
    await listener.close()
    assert conn.terminated and not listener.alive


async def test_close_after_the_server_ended_the_connection(database_url: str) -> None:
    store = await open_store(database_url)
    try:
        listener = await store.listen(lambda: None)
        assert isinstance(listener, Listener) and listener.alive
        killer = await asyncpg.connect(database_url)
        try:
            assert await killer.fetchval("SELECT pg_terminate_backend($1)", listener.conn.get_server_pid())
        finally:
            await killer.close()
        await listener.close()  # whether or not the driver has noticed yet, and mid-UNLISTEN included
        assert not listener.alive
    finally:
        await store.close()


async def test_listen_due_reports_seconds_until_the_notified_time(database_url: str) -> None:
    """The commands channel's payload is an available time on the server's clock, then the command's
    definition after a colon; `listen_due` turns the time into seconds from now on this process's clock,
    and an unreadable one into "due now"."""
    store = await open_store(database_url)
    got: asyncio.Queue[tuple[float, str | None]] = asyncio.Queue()
    try:
        listener = await store.listen_due(lambda due_in, definition: got.put_nowait((due_in, definition)))
        notifier = await asyncpg.connect(database_url)
        try:
            at = "(extract(epoch FROM clock_timestamp() + make_interval(secs => $2)) * 1000)::bigint::text"
            for ahead in (30.0, -5.0):
                await notifier.execute(f"SELECT pg_notify($1, {at} || ':orders')", store.channel, ahead)
                due_in, definition = await asyncio.wait_for(got.get(), 10)
                assert abs(due_in - ahead) < 0.5 and definition == "orders"
            await notifier.execute(f"SELECT pg_notify($1, {at})", store.channel, 1.0)  # a payload without one
            assert (await asyncio.wait_for(got.get(), 10))[1] is None
            await notifier.execute("SELECT pg_notify($1, 'not a time')", store.channel)
            assert await asyncio.wait_for(got.get(), 10) == (0.0, None)
        finally:
            await notifier.close()
        await listener.close()
    finally:
        await store.close()
