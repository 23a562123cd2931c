"""Prometheus metrics, the health probes and JSON logs of a worker."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from datetime import timedelta

import asyncpg
import pytest

from stepstone.cli.worker import health_beside
from stepstone.observability.logs import JsonFormatter
from stepstone.testing import Engine
from tests.crashes import die_alone
from tests.observability import workflows
from tests.observability.workflows import traced, wobbly

metrics_module = pytest.importorskip("stepstone.observability.metrics",
                                     reason="prometheus_client is the prometheus extra (in .[test])")


@pytest.fixture
def metrics() -> object:
    m = metrics_module.WorkerMetrics().install()
    yield m
    m.uninstall()


def _value(metrics: object, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0  # type: ignore[attr-defined]


async def test_counters_and_histograms(engine: Engine, metrics: object) -> None:
    ok = await engine.client.start(wobbly, {})
    retried = await engine.client.start(wobbly, {})
    dead = await engine.client.start(wobbly, {})
    workflows.FLAKY.update({retried: 1, dead: 5})
    for _ in range(3):
        await engine.advance(seconds=1)
    assert (await engine.client.get(ok)).status == "COMPLETED"
    assert (await engine.client.get(retried)).status == "COMPLETED"
    assert (await engine.client.get(dead)).status == "FAILED"
    assert _value(metrics, "stepstone_steps_total", workflow="wobbly", step="work", outcome="ok") == 2
    assert _value(metrics, "stepstone_steps_total", workflow="wobbly", step="work", outcome="failed") == 3
    assert _value(metrics, "stepstone_retries_total") == 2
    assert _value(metrics, "stepstone_commits_total", outcome="ok", settle="FAILED") == 1  # retries exhausted
    assert _value(metrics, "stepstone_step_duration_seconds_count", workflow="wobbly", step="work") == 5
    assert _value(metrics, "stepstone_claims_total", workflow="wobbly", kind="START") == 5  # a retry re-claims
    assert _value(metrics, "stepstone_commits_total", outcome="ok", settle="COMPLETE") >= 2
    text = metrics.exposition().decode()  # type: ignore[attr-defined]
    assert "stepstone_fenced_commits_total 0.0" in text
    assert ok not in text  # no instance ids as labels


_LABELS = {"workflow", "step", "outcome", "settle", "kind", "state", "le"}
"""Every label a metric may have: bounded sets (workflows, steps, states), never an instance's id."""
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


async def test_every_metric_follows_the_naming_rules(engine: Engine, metrics: object) -> None:
    ids = [await engine.client.start(wobbly, {}) for _ in range(2)]
    await engine.advance(seconds=1)
    metrics.record_sample(await engine.store.sample())  # type: ignore[attr-defined]  # the gauges too
    families = list(metrics.registry.collect())  # type: ignore[attr-defined]
    assert len(families) >= 14  # every metric the worker defines
    for family in families:
        assert family.name.startswith("stepstone_"), family.name  # one prefix
        if family.type == "histogram":  # every histogram is a duration, in seconds
            assert family.name.endswith("_seconds"), family.name
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name in (f"{family.name}_total", f"{family.name}_created"), sample.name
            assert set(sample.labels) <= _LABELS, (sample.name, sample.labels)
            assert not any(_UUID.search(v) for v in sample.labels.values()), (sample.name, sample.labels)
    text = metrics.exposition().decode()  # type: ignore[attr-defined]
    assert not any(i in text for i in ids)
    assert not _UUID.search(text)


async def test_lease_expiries_and_dead_letters_are_counted(engine: Engine, metrics: object) -> None:
    iid = await engine.client.start(traced, {})
    await engine.store.claim(1, 1, "a-worker-that-dies")
    await engine.move_clock(timedelta(seconds=2))
    await engine.run_until_idle()
    assert _value(metrics, "stepstone_lease_expiries_total", workflow="traced") == 1
    assert (await engine.client.get(iid)).status == "WAITING"

    poison = await engine.client.start(traced, {})
    await die_alone(engine, lease=1)  # every claim dies before it settles, all but the first alone
    await engine.run_until_idle()
    assert (await engine.client.get(poison)).status == "FAILED"
    assert _value(metrics, "stepstone_dead_letters_total") == 1


async def test_the_sample_is_taken_by_one_worker_at_a_time(engine: Engine, database_url: str) -> None:
    await engine.client.start(traced, {})
    sample = await engine.store.sample()  # type: ignore[attr-defined]
    assert sample["states"] == {"PENDING": 1}
    assert sample["outbox_pending"] == 0
    conn = await asyncpg.connect(database_url)
    try:
        async with conn.transaction():
            assert await conn.fetchval(
                "SELECT pg_try_advisory_xact_lock(hashtextextended('stepstone.sample:' || '\"stepstone\"', 0))")
            assert await engine.store.sample() is None  # type: ignore[attr-defined]
    finally:
        await conn.close()


async def _request(port: int, method: str, path: str) -> tuple[str, str]:
    """The head and the body of the answer (the server closes the connection after it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.decode().partition("\r\n\r\n")
    return head, body


async def _get(port: int, path: str) -> tuple[int, str]:
    head, body = await _request(port, "GET", path)
    return int(head.split()[1]), body


async def test_probes_and_metrics_on_the_workers_port(engine: Engine) -> None:
    worker = engine.new_worker()
    await worker.start()
    try:
        async with health_beside(worker, engine.store, "127.0.0.1", 0) as server:
            assert await _get(server.port, "/livez") == (200, '{"alive": true}')
            status, body = await _get(server.port, "/readyz")
            assert status == 200
            assert json.loads(body) == {"ready": True, "checks": {"database": True, "schema": True, "plans": True,
                                                                  "claiming": True}}
            await engine.client.start(traced, {})
            status, text = await _get(server.port, "/metrics")
            assert status == 200
            assert "stepstone_commands{state=" in text and "# TYPE stepstone_steps_total counter" in text
            assert (await _get(server.port, "/nope"))[0] == 404
            head, _ = await _request(server.port, "POST", "/livez")  # it had no Allow header
            assert head.split()[1] == "405" and "\r\nAllow: GET, HEAD\r\n" in head, head
            for path in ("/livez", "/readyz", "/metrics", "/nope"):  # HEAD: GET's status and headers, no body
                head, body = await _request(server.port, "HEAD", path)
                assert body == "", (path, body)
                got_head, got_body = await _request(server.port, "GET", path)
                assert head.split()[1] == got_head.split()[1], path
                if path != "/metrics":  # a sample may change between the two
                    assert f"Content-Length: {len(got_body)}" in head, head
            await worker.stop()
            assert (await _get(server.port, "/livez"))[0] == 503
    finally:
        await worker.stop()


async def test_readiness_fails_when_the_schema_is_behind(engine: Engine, database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("DELETE FROM stepstone.schema_migrations WHERE version = "
                           "(SELECT max(version) FROM stepstone.schema_migrations)")
    finally:
        await conn.close()
    from stepstone.observability.health import HealthServer  # noqa: PLC0415

    server = HealthServer(engine.worker, engine.store, port=0)  # type: ignore[arg-type]
    # The testing engine's worker runs by run_until_idle and never claims on its own: not ready either way.
    assert await server.readiness() == {"database": True, "schema": False, "plans": True, "claiming": False}


async def test_json_logs_carry_the_step(engine: Engine) -> None:
    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = Capture()
    handler.setFormatter(JsonFormatter())
    workflows.log.addHandler(handler)
    workflows.log.setLevel(logging.INFO)
    try:
        iid = await engine.client.start(wobbly, {})
        await engine.run_until_idle()
    finally:
        workflows.log.removeHandler(handler)
    [line] = [json.loads(r) for r in records]
    assert {k: line[k] for k in ("message", "instance", "position", "step", "attempt", "workflow", "level")} == {
        "message": "working", "instance": iid, "position": "", "step": "work", "attempt": 1, "workflow": "wobbly",
        "level": "info"}


async def test_start_to_first_step_is_measured_on_the_database_clock(engine: Engine, metrics: object) -> None:
    await engine.client.start(wobbly, {})
    await engine.move_clock(timedelta(seconds=5))  # the instance waits 5 s (of database clock) for a worker
    await engine.run_until_idle()
    assert _value(metrics, "stepstone_start_to_first_step_seconds_count", workflow="wobbly") == 1
    assert _value(metrics, "stepstone_start_to_first_step_seconds_sum", workflow="wobbly") >= 5


async def test_an_overlong_request_line_or_header_is_431_and_logs_nothing(
    engine: Engine, caplog: pytest.LogCaptureFixture,
) -> None:
    """The probe port's reader takes lines of up to 64 KiB: a longer request line or header line, or a flood of
    header lines, is answered 431 and the connection closed. A longer line was an unhandled ValueError in the
    connection's callback: no answer, and asyncio's ERROR with a traceback in the worker's log each time."""
    from stepstone.observability.health import HealthServer  # noqa: PLC0415

    server = HealthServer(engine.worker, engine.store, host="127.0.0.1", port=0)  # type: ignore[arg-type]
    await server.start()
    try:
        for sent in (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n",
                     b"GET /livez HTTP/1.1\r\nX-Long: " + b"b" * 70_000 + b"\r\n\r\n",
                     b"GET /livez HTTP/1.1\r\n" + b"X-Many: c\r\n" * 200 + b"\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(sent)
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 30)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 431 "), answer[:80]
        assert (await _get(server.port, "/livez"))[0] in (200, 503)  # it still answers
    finally:
        await server.stop()
    assert [r.getMessage()[:80] for r in caplog.records if r.levelno >= logging.ERROR] == []
