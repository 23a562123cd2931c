"""`SyncClient` is generated from `Client` into a checked-in module: type checkers see every method,
and this test fails when the module is stale."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from mypy import api as mypy_api

from stepstone import SyncClient, Worker, WorkerConfig, _gen_sync, _sync_client
from stepstone.client import Client
from stepstone.config import DEFAULT_SCHEMA
from stepstone.errors import ClientClosed, InvalidInput
from tests import cli_apps
from tests._pg import until_waiting_for_a_lock


def public_coroutines() -> list[str]:
    return [name for name, member in vars(Client).items()
            if not name.startswith("_") and name not in ("connect", "close") and inspect.iscoroutinefunction(member)]


def test_the_generated_module_is_current() -> None:
    texts = _gen_sync.generate()
    assert Path(_sync_client.__file__) in texts
    for path, text in texts.items():
        assert path.read_text(encoding="utf-8") == text, (
            f"src/stepstone/{path.name} is stale: run `python -m stepstone._gen_sync`")
    assert _gen_sync.main(["--check"]) == 0


def test_a_change_to_client_makes_it_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    async def archive(self: Client, instance_id: str) -> None:
        """A new operation."""

    monkeypatch.setattr(Client, "archive", archive, raising=False)
    assert "def archive(self, instance_id: str) -> None:" in _gen_sync.generate()[Path(_sync_client.__file__)]
    assert _gen_sync.main(["--check"]) == 1


def test_every_operation_is_a_real_method_with_the_same_signature() -> None:
    assert not any("__getattr__" in vars(klass) for klass in SyncClient.__mro__)
    for name in public_coroutines():
        method = inspect.getattr_static(SyncClient, name, None)  # its own, or a generated mixin's
        assert method is not None and not inspect.iscoroutinefunction(method), name
        assert inspect.signature(method) == inspect.signature(getattr(Client, name)), name
        assert inspect.getdoc(method) == inspect.getdoc(getattr(Client, name)), name
    connect = inspect.signature(Client.connect)
    assert list(inspect.signature(SyncClient.__init__).parameters)[1:] == list(connect.parameters)


def test_type_checkers_see_the_methods(tmp_path: Path) -> None:
    out, err, status = _mypy_strict(tmp_path, (
        "from stepstone import SyncClient\n"
        "def use(client: SyncClient) -> str:\n"
        "    client.strat('order')\n"
        "    return client.start('order', {}, business_key=1)\n"
    ))
    assert status == 1, out + err
    assert '"SyncClient" has no attribute "strat"' in out
    assert 'Argument "business_key" to "start" of "SyncClient"' in out


def test_the_documented_worker_beside_a_client_type_checks(tmp_path: Path) -> None:
    """docs/authoring.md's "Running a worker in your own process" hands `client.store` to `Worker`: under
    `mypy --strict` that was 'Argument 1 to "Worker" has incompatible type "ClientStore"' until `Client`
    became generic in its store (`connect` returns a `Client[Store]`); a bare `Client` annotation, as
    users write it, must still take what `connect` returns."""
    docs = (Path(__file__).parent.parent / "docs" / "authoring.md").read_text(encoding="utf-8")
    block = docs.split("## Running a worker in your own process", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    out, err, status = _mypy_strict(tmp_path, block + (
        "async def use(client: Client) -> str:\n"
        "    return await client.start('order', {})\n"
        "async def connected() -> str:\n"
        "    async with await Client.connect(registry=registry) as client:\n"
        "        Worker(client.store, registry)\n"
        "        return await use(client)\n"
    ))
    assert status == 0, out + err


def test_it_runs_the_operations(database_url: str) -> None:
    with SyncClient(database_url, registry=cli_apps.registry) as client:
        instance_id = client.start("approval", business_key="b-1")
        assert client.get(instance_id).status == "PENDING"
        rows: list[dict[str, Any]] = client.list(business_key="b-1")
        assert [r["id"] for r in rows] == [instance_id]
        assert client.cancel(instance_id, "no longer wanted") == "CANCELLED"
        assert client.wait_for(instance_id, timeout=1).status == "CANCELLED"
        history = client.history(instance_id)  # root entries say '' (the root's path), as history_page does
        assert [(h["kind"], h["position"]) for h in history] == [(e.kind, e.position) for e in
                                                                 client.history_page(instance_id).entries]
        assert [h["position"] for h in history if h["kind"] == "INSTANCE_STARTED"] == [""]
    assert not client._thread.is_alive()


def test_a_closed_client_says_so(database_url: str) -> None:
    """A call after close() was RuntimeError('Event loop is closed') with a 'never awaited' warning, and
    a second close() the same."""
    client = SyncClient(database_url, registry=cli_apps.registry)
    client.close()
    client.close()  # closing again does nothing
    with _no_warning(), pytest.raises(ClientClosed, match="this SyncClient is closed"):
        client.list()


def test_a_call_from_a_callback_the_client_runs_is_refused_not_a_hang(database_url: str) -> None:
    """A callback that a SyncClient method runs (start_many's on_batch, migrate's state_transform) runs on the
    client's loop thread; a call of the same client there waited for that thread, itself, for ever."""
    refused: list[str] = []
    client = SyncClient(database_url, registry=cli_apps.registry)
    first = client.start("approval")

    def progress(_done: int, _total: int) -> None:
        with _no_warning():
            try:
                client.get(first)
            except InvalidInput as exc:
                refused.append(str(exc))

    call = threading.Thread(target=client.start_many, args=("approval", [{}, {}]), kwargs={"on_batch": progress},
                            daemon=True)
    call.start()
    call.join(timeout=60)
    assert not call.is_alive(), "the call from the callback never returned"  # (not closed: it would hang too)
    assert client.get(first).status == "PENDING"  # the client still works
    client.close()
    assert refused == [("SyncClient.get was called on the client's own loop thread, from a callback one of its "
                        "calls runs (on_batch, state_transform, ...): it would wait for itself for ever; call it "
                        "after that call returns")]


def test_an_async_connection_given_to_a_sync_client_is_refused(database_url: str) -> None:
    """A SyncClient used inside an event loop with that loop's asyncpg connection ran the statement on its
    own loop thread while the connection's loop waited for the call: "got Future attached to a different
    loop", and the caller's transaction was left unusable ("another operation is in progress")."""

    async def inside() -> tuple[str, int]:
        conn = await asyncpg.connect(database_url)
        try:
            async with conn.transaction():
                with pytest.raises(InvalidInput) as refused:
                    client.start("approval", connection=conn)
                return str(refused.value), await conn.fetchval("SELECT 1")  # the transaction goes on
        finally:
            await conn.close()

    with SyncClient(database_url, registry=cli_apps.registry) as client:
        message, one = asyncio.run(inside())
        assert client.list() == []
    assert one == 1
    assert message == ("connection= of a SyncClient takes a sync connection (psycopg Connection, SQLAlchemy Session "
                       "or Connection): an async one belongs to an event loop, which waits for this call and whose "
                       "connection would be left unusable; use Client on that loop")


async def test_a_closed_async_client_says_so(database_url: str) -> None:
    """A call on the async Client after close() was DatabaseUnavailable ('cannot reach PostgreSQL ...: pool
    is closed'), a transient error that a caller's retry would repeat for ever. A worker on the closed
    client's store still stops (its claims cannot be released: their leases expire)."""
    client = await Client.connect(database_url, registry=cli_apps.registry)
    worker = Worker(client.store, cli_apps.registry, WorkerConfig(concurrency=1, drain_timeout=0))
    await worker.start()
    instance_id = await client.start("approval")
    await client.close()
    for call in (client.start("approval"), client.get(instance_id), client.list(), client.cancel(instance_id)):
        with pytest.raises(ClientClosed, match="this store is closed"):
            await call
    assert await worker.stop() == 0


def _mypy_strict(tmp_path: Path, text: str) -> tuple[str, str, int]:
    """mypy --strict over `text` as a user's module: its report, errors and exit status."""
    snippet = tmp_path / "snippet.py"
    snippet.write_text(text)
    return mypy_api.run(["--strict", "--no-error-summary", "--config-file", "", "--cache-dir",
                         str(tmp_path / "cache"), str(snippet)])


@contextlib.contextmanager
def _no_warning() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" would fail the test
        yield


def test_a_sync_connections_statement_holds_up_no_other_threads_call(database_url: str) -> None:
    """A start in the caller's transaction on a sync connection (the Django backend's enqueue inside atomic())
    ran its statement on the client's loop thread: while it waited for a lock, every other thread's call
    through the same client waited as long."""
    psycopg = pytest.importorskip("psycopg", reason="psycopg 3 is in the test extra")
    with (SyncClient(database_url, registry=cli_apps.registry) as client,
          psycopg.connect(database_url, autocommit=True) as blocker, psycopg.connect(database_url) as caller):
        known = client.start("approval")
        started: list[str] = []
        read: list[str] = []

        def start_in_the_callers_transaction() -> None:
            with caller.transaction():
                started.append(client.start("approval", connection=caller))

        starting = threading.Thread(target=start_in_the_callers_transaction)
        other = threading.Thread(target=lambda: read.append(client.get(known).id))
        with blocker.transaction():
            blocker.execute(f"LOCK TABLE {DEFAULT_SCHEMA}.instances IN SHARE MODE")  # the start's insert waits
            starting.start()
            asyncio.run(until_waiting_for_a_lock(database_url, caller.info.backend_pid))
            other.start()
            other.join(timeout=20)
            assert read == [known], "another thread's call waited for the start's lock"
        starting.join(timeout=20)
        assert len(started) == 1 and client.get(started[0]).id == started[0]
