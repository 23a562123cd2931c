"""``stepstone outbox status | list | requeue``, ``stepstone relay`` as a process, the relay inside
``stepstone worker``, and ``stepstone demo outbox``."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import uuid
from collections.abc import AsyncIterator, Sequence

import asyncpg
import pytest
from click.testing import CliRunner

from stepstone.cli import cli
from stepstone.errors import BrokerMisconfigured
from stepstone.outbox.publisher import PublishResult
from stepstone.outbox.relay import Relay
from stepstone.store.outbox import PostgresOutbox, Settlement, StagedEvent
from stepstone.store.postgres import PostgresStore
from tests.outbox.brokers import Kind, open_kind
from tests.outbox.conftest import claim, held_by_a_refused_setup, stage
from tests.test_cli_worker import DEADLINE, ROOT, STEPSTONE, WorkerProcess, start_worker


@pytest.fixture
async def outbox(database_url: str) -> AsyncIterator[PostgresOutbox]:
    store = await PostgresStore.open(database_url, max_size=4)
    try:
        yield PostgresOutbox(store)
    finally:
        await store.close()


@pytest.fixture
async def webhook() -> AsyncIterator[Kind]:
    kind = await open_kind("webhook")
    try:
        yield kind
    finally:
        await kind.cleanup()


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


async def run(*args: str) -> tuple[int, str, str]:
    """The CLI runs its own event loop: call it from a thread."""
    return await asyncio.to_thread(invoke, *args)


async def test_status_list_and_requeue(conn: asyncpg.Connection, outbox: PostgresOutbox, database_url: str) -> None:
    staged = await stage(conn, ["a", "a", "b"])
    token, first = await claim(outbox, limit=1)
    await outbox.settle(token, [Settlement(first[0], "dead", "refused: no route", counted=True)])
    code, out, _ = await run("outbox", "status", "--database-url", database_url, "-o", "json")
    assert code == 0
    status = json.loads(out)
    assert (status["pending"], status["dead"], status["published"]) == (2, 1, 0)
    code, out, _ = await run("outbox", "list", "--database-url", database_url)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["id", "type", "key", "attempts", "state", "last", "error"]
    assert "dead" in lines[1] and "refused: no route" in lines[1]
    assert "behind a dead event of its key" in lines[2]
    assert lines[3].split()[-1] == "pending"
    code, out, _ = await run("outbox", "list", "--dead", "--database-url", database_url, "-o", "json")
    assert [r["id"] for r in json.loads(out)] == [staged[0][0]]
    assert [r["created_at"][10] for r in json.loads(out)] == ["T"], "ISO 8601, as every -o json"
    code, _, err = await run("outbox", "requeue", "--database-url", database_url)
    assert code == 1 and "give event ids or --all-dead" in err
    dead, alive = str(staged[0][0]), str(staged[2][0])
    code, out, err = await run("outbox", "requeue", dead, alive, "--database-url", database_url)
    assert code == 1
    assert out.strip() == f"requeued 1 event(s): {staged[0][0]}"
    assert f"not dead-lettered (or unknown): {staged[2][0]}" in err
    code, out, _ = await run("outbox", "requeue", "--all-dead", "--database-url", database_url)
    assert (code, out.strip()) == (0, "requeued 0 event(s)")
    assert (await outbox.status()).dead == 0


class RefusingBroker:
    """A broker that refuses the publisher's setup, as a webhook answering 401 does."""

    name = "https://hooks.example.com/events"

    async def publish(self, batch: Sequence[StagedEvent]) -> list[PublishResult]:  # noqa: ARG002 - the port's signature
        raise BrokerMisconfigured(f"{self.name}: HTTP 401 Unauthorized")

    async def close(self) -> None:
        pass


async def test_status_says_why_the_outbox_is_held(
    conn: asyncpg.Connection, outbox: PostgresOutbox, database_url: str
) -> None:
    """A broker refusing the publisher's setup holds the events as pending with no attempt counted:
    status said only `pending`, its reason was in `outbox list` and the relay's log alone."""
    await stage(conn, ["a", None])
    code, out, _ = await run("outbox", "status", "--database-url", database_url, "-o", "json")
    assert json.loads(out)["oldest_pending_error"] is None
    relay = Relay(outbox, RefusingBroker())
    assert isinstance(await held_by_a_refused_setup(relay), BrokerMisconfigured)
    code, out, _ = await run("outbox", "status", "--database-url", database_url, "-o", "json")
    status = json.loads(out)
    assert (status["pending"], status["backing_off"], status["dead"]) == (2, 0, 0)
    assert status["oldest_pending_error"] == "https://hooks.example.com/events: HTTP 401 Unauthorized"
    code, out, _ = await run("outbox", "status", "--database-url", database_url)
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("oldest pending error"))
    assert row.split(None, 3)[-1] == "https://hooks.example.com/events: HTTP 401 Unauthorized"


def test_relay_needs_a_broker(database_url: str) -> None:
    code, _, err = invoke("relay", "--database-url", database_url)
    assert code == 1 and "no broker configured" in err
    code, _, err = invoke("relay", "--database-url", database_url, "--broker", "kafka://127.0.0.1:9092")
    assert code == 1 and "no publisher for broker URL 'kafka://127.0.0.1:9092'" in err
    for command in ("relay", "worker"):  # the worker's relay was turned off without a word
        code, _, err = invoke(command, "--database-url", database_url, "--broker", "",
                              *(["--app", "stepstone.examples.orders:registry"] if command == "worker" else []))
        assert code == 1 and err.strip() == ("error: --broker is empty: give a broker URL or leave the flag out "
                                             "(--no-relay turns it off)"), err


async def wait_received(webhook: Kind, count: int) -> None:
    """Until the webhook has received `count` events. The relay records a batch as published after the
    broker's answer, and on a stop finishes the batch in hand: the test checks the record after the exit."""
    await webhook.extra["server"].received_at_least(count, DEADLINE)


async def test_relay_process_publishes_then_stops_on_sigterm(
    conn: asyncpg.Connection, outbox: PostgresOutbox, database_url: str, webhook: Kind
) -> None:
    staged = await stage(conn, ["a", None, "a"])
    proc = WorkerProcess(await asyncio.create_subprocess_exec(
        *STEPSTONE, "relay", "--database-url", database_url, "--broker", webhook.url,
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}))
    await proc.line_containing("started: publishing to http://")
    await wait_received(webhook, 3)
    proc.proc.send_signal(signal.SIGTERM)
    assert await proc.exit_code(DEADLINE) == 0
    assert "stopped: 3 event(s) published" in "".join(proc.lines)
    assert await outbox.published_count() == 3
    assert sorted(e for e, _, _ in await webhook.read()) == sorted(e for _, e, _ in staged)


async def test_the_worker_runs_the_relay_when_a_broker_is_configured(
    conn: asyncpg.Connection, outbox: PostgresOutbox, database_url: str, webhook: Kind,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STEPSTONE_BROKER_URL", webhook.url)
    await stage(conn, ["a", "b"])
    worker = await start_worker(database_url)
    await worker.line_containing("relay relay:")
    await wait_received(webhook, 2)
    worker.proc.send_signal(signal.SIGTERM)
    assert await worker.exit_code(DEADLINE) == 0
    assert await outbox.published_count() == 2
    log = "".join(worker.lines)
    assert log.index("drained") < log.index("stopped: 2 event(s) published"), "the relay stops after the worker"

    off = await start_worker(database_url, "--no-relay")
    await off.line_containing("worker ")
    off.proc.send_signal(signal.SIGTERM)
    assert await off.exit_code(DEADLINE) == 0
    assert "relay" not in "".join(off.lines)


LAST = re.compile(r"^outbox: (\d+) events published to (\S+) in per-key order; 0 pending$")


def test_demo_outbox(empty_database_url: str) -> None:
    result = CliRunner().invoke(cli, ["demo", "outbox", "--database-url", empty_database_url],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    last = LAST.match(lines[-1])
    assert last is not None, lines[-1]
    assert last.group(1) == "3", "the order emits reserved, shipped and receipt"
    assert last.group(2) in ("redis://127.0.0.1:6379", "memory://demo")
    assert [line.split()[1] for line in lines[-4:-1]] == ["order.reserved", "order.shipped", "order.receipt"]
    assert "instance completed" in result.stdout


def test_demo_outbox_to_the_in_memory_broker(database_url: str) -> None:
    result = CliRunner().invoke(cli, ["demo", "outbox", "--broker", "memory://elsewhere",
                                      "--database-url", database_url], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    want = "outbox: 3 events published to memory://elsewhere in per-key order; 0 pending"
    assert result.stdout.splitlines()[-1] == want


async def test_demo_outbox_leaves_an_applications_events_alone(
    conn: asyncpg.Connection, outbox: PostgresOutbox, database_url: str
) -> None:
    """A relay publishes every event of its schema's outbox: in the application's schema the demo's relay
    took the application's events (published to the demo's broker, the in-memory one keeping nothing, and
    marked published, so the application's relay never sent them), and an application's relay would have
    taken the demo's. The demo refused to run beside events already staged, but not beside those an
    application staged while it ran. On a configured database it now runs in a schema of its own."""
    await stage(conn, ["app-1", "app-2"], type_="invoice.issued")
    code, out, err = await run("demo", "outbox", "--broker", "memory://app-events", "--database-url", database_url)
    assert code == 0, err
    last = "outbox: 3 events published to memory://app-events in per-key order; 0 pending"
    assert out.strip().splitlines()[-1] == last
    assert "schema stepstone_demo is the demo's own" in out
    assert await outbox.published_count() == 0
    assert (await outbox.status()).pending == 2, "the application's outbox holds its own events alone"
    demo = await conn.fetch("SELECT type, published_at IS NOT NULL AS sent FROM stepstone_demo.outbox ORDER BY id")
    assert [(r["type"], r["sent"]) for r in demo] == [
        ("order.reserved", True), ("order.shipped", True), ("order.receipt", True)]


async def test_demo_outbox_after_the_order_demo_on_a_configured_database_leaves_its_events_to_their_relay(
    outbox: PostgresOutbox, database_url: str
) -> None:
    """`stepstone demo` then `stepstone demo outbox` on a configured database: the first leaves its order's
    events pending in the configured schema (no relay), where the application's relay publishes them; the
    second publishes its own order's, in its own schema. (On the embedded default, the demos' own database,
    both run in one schema and the second publishes the first's events too.)"""
    code, out, err = await run("demo", "--database-url", database_url)
    assert code == 0, err
    left = (await outbox.status()).pending
    assert left > 0
    code, out, err = await run("demo", "outbox", "--broker", "memory://after-demo", "--database-url", database_url)
    assert code == 0, err
    assert out.strip().splitlines()[-1] == (
        "outbox: 3 events published to memory://after-demo in per-key order; 0 pending")
    assert (await outbox.status()).pending == left


async def test_demo_outbox_refuses_a_broker_it_cannot_read_back_before_it_runs(
    outbox: PostgresOutbox, database_url: str, webhook: Kind
) -> None:
    """With a broker it cannot read back (a webhook, NATS, RabbitMQ) the demo ran the order, published its
    events for real and only then failed: "the demo cannot read ... back"."""
    code, out, err = await run("demo", "outbox", "--broker", webhook.url_for(webhook.base_url),
                               "--database-url", database_url)
    assert code == 1, out
    assert "it can read only Redis or the in-memory broker" in err
    assert "instance" not in out, "no order was run"
    assert await webhook.read() == []
    assert await outbox.published_count() == 0


async def test_discard_dead_letters(conn: asyncpg.Connection, outbox: PostgresOutbox, database_url: str) -> None:
    held = uuid.uuid4()
    staged = await stage(conn, ["a"], instance=held) + await stage(conn, ["a", "b"])
    token, first = await claim(outbox, limit=1)
    await outbox.settle(token, [Settlement(first[0], "dead", "refused: no route", counted=True)])
    dead, behind, other = (str(s[0]) for s in staged)
    assert await outbox.unsent_instances([str(held)]) == {str(held)}  # retention keeps it while dead
    code, _, err = await run("outbox", "discard", dead, "--database-url", database_url)
    assert code == 2 and "--reason" in err  # the reason is required
    code, out, err = await run("outbox", "discard", dead, other, "--reason", "replayed by hand",
                               "--database-url", database_url)
    assert code == 1
    assert out.strip() == f"discarded 1 event(s): {dead}"
    assert f"not dead-lettered (or unknown): {other}" in err  # a pending event is never discarded
    code, out, _ = await run("outbox", "status", "--database-url", database_url, "-o", "json")
    status = json.loads(out)
    assert (status["pending"], status["dead"], status["published"], status["discarded"]) == (2, 0, 0, 1)
    row = await conn.fetchrow("SELECT * FROM stepstone.outbox WHERE id = $1", staged[0][0])
    assert row["discarded_at"] is not None and row["last_error"].startswith("discarded: replayed by hand")
    # its key resumes: the event behind it is claimed now, and the instance is no longer held by it
    _, claimed = await claim(outbox, limit=10)
    assert int(behind) in claimed
    assert await outbox.unsent_instances([str(held)]) == set()  # and retention may purge its instance
    code, out, _ = await run("outbox", "discard", "--all-dead", "--reason", "x", "--database-url", database_url)
    assert (code, out.strip()) == (0, "discarded 0 event(s)")


async def test_list_says_what_status_counts_an_expired_lease_and_a_past_retry_are_pending(
    conn: asyncpg.Connection, outbox: PostgresOutbox, database_url: str
) -> None:
    """`outbox list` said "leased by relay:..." for a lease that had expired and "retry at" a time gone by,
    while `outbox status` counted neither as in flight nor backing off."""
    await stage(conn, ["a", "b", "c"])
    await claim(outbox, limit=1, relay="relay:gone")
    token, second = await claim(outbox, limit=1)
    await outbox.settle(token, [Settlement(second[0], "retry", "nack", 60, counted=True)])

    async def states() -> tuple[list[str], dict[str, int]]:
        code, out, _ = await run("outbox", "list", "--database-url", database_url, "-o", "json")
        assert code == 0
        listed = [r["state"] for r in json.loads(out)]
        code, out, _ = await run("outbox", "status", "--database-url", database_url, "-o", "json")
        status = json.loads(out)
        assert listed.count("in_flight") == status["in_flight"]
        assert listed.count("backing_off") == status["backing_off"]
        return listed, status

    assert (await states())[0] == ["in_flight", "backing_off", "pending"]
    _, out, _ = await run("outbox", "list", "--database-url", database_url)
    assert "leased by relay:gone until" in out.splitlines()[1]
    assert "backing off until" in out.splitlines()[2]
    await outbox.store.move_clock(61)
    assert (await states())[0] == ["pending", "pending", "pending"]
    _, out, _ = await run("outbox", "list", "--database-url", database_url)
    assert [line.split()[4] for line in out.splitlines()[1:]] == ["pending"] * 3
    assert "leased" not in out and "retry at" not in out and "backing off" not in out


async def test_requeue_and_discard_answer_in_json(conn: asyncpg.Connection, outbox: PostgresOutbox,
                                                 database_url: str) -> None:
    """`-o json` on both repairs: a result per event named (as the API's requeue), still exit 1 for one not dead."""
    staged = await stage(conn, ["a", "b", "c"])
    token, claimed = await claim(outbox, limit=2)
    await outbox.settle(token, [Settlement(e, "dead", "refused", counted=True) for e in claimed])
    first, second, alive = (e[0] for e in staged)
    code, out, err = await run("outbox", "requeue", str(first), str(alive), "--database-url", database_url,
                               "-o", "json")
    assert code == 1 and f"not dead-lettered (or unknown): {alive}" in err
    assert json.loads(out) == {"matched": 1, "results": [{"id": first, "result": "requeued"},
                                                         {"id": alive, "result": "not_dead"}]}
    code, out, _ = await run("outbox", "discard", "--all-dead", "--reason", "by hand", "--database-url",
                             database_url, "-o", "json")
    assert code == 0
    assert json.loads(out) == {"matched": 1, "results": [{"id": second, "result": "discarded"}]}
