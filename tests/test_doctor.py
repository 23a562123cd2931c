"""`stepstone doctor` shows the commands deferred because no worker has their pin (issue 9, item 19)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
from typing import Any

import pytest
from click.testing import CliRunner, Result

from stepstone.authoring.workflow import Registry, StepContext, Workflow
from stepstone.cli import cli
from stepstone.core.pin import pin_of
from stepstone.store.postgres import PostgresStore
from stepstone.testing import open_engine

kept: Workflow[Any] = Workflow("doctor_kept", version=1)
stranded_v1: Workflow[Any] = Workflow("doctor_stranded", version=1)
stranded_v2: Workflow[Any] = Workflow("doctor_stranded", version=2)
# The worker serves v3 of doctor_stranded (so it claims that workflow's commands) but not v1 or v2.
served_v3: Workflow[Any] = Workflow("doctor_stranded", version=3)


@kept.step(start=True)
def kept_step(ctx: StepContext, state: dict[str, Any]) -> None:
    state["ran"] = True


@stranded_v1.step(start=True)
def stranded_step_1(ctx: StepContext, state: dict[str, Any]) -> None:
    state["ran"] = True


@stranded_v2.step(start=True)
def stranded_step_2(ctx: StepContext, state: dict[str, Any]) -> None:
    state["ran"] = True


@served_v3.step(start=True)
def stranded_step_3(ctx: StepContext, state: dict[str, Any]) -> None:
    state["ran"] = True


def doctor(database_url: str, *args: str) -> Result:
    return CliRunner().invoke(cli, ["--database-url", database_url, "doctor", *args], catch_exceptions=False)


async def start_and_defer(database_url: str) -> tuple[int, int]:
    """Start 2 instances of v1 and 1 of v2 of a workflow whose v3 alone the worker has, and one of a workflow
    it has; run the worker.
    Returns (deferrals the worker made, completed instances) and checks doctor in between."""
    async with open_engine(database_url, Registry(kept, served_v3), concurrency=4) as engine:
        await engine.client.start(stranded_v1, {})
        await engine.client.start(stranded_v1, {})
        await engine.client.start(stranded_v2, {})
        done = await engine.client.start(kept, {})
        pending = await asyncio.to_thread(doctor, database_url)
        assert pending.exit_code == 0, pending.output
        assert "command(s) of" not in pending.stdout  # PENDING commands are not deferred ones
        await engine.run_until_idle()
        info = await engine.client.get(done)
        return engine.worker.events.deferred, int(info.completed)


def test_doctor_warns_of_commands_no_worker_can_run(database_url: str) -> None:
    assert asyncio.run(start_and_defer(database_url)) == (3, 1)

    result = doctor(database_url)
    assert result.exit_code == 0, result.output  # a warning, not a problem
    assert "status: ok" in result.stdout
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning: ") and "command(s)" in line]
    assert len(warnings) == 2, result.stdout  # one line per pin, not per command
    stranded = [line for line in result.stdout.splitlines() if "are stranded" in line]
    assert [line.split(" (plan")[0] for line in stranded] == [  # no worker ever heartbeated here
        "warning: 2 instance(s) of doctor_stranded v1", "warning: 1 instance(s) of doctor_stranded v2"]
    v1, v2 = pin_of(stranded_v1), pin_of(stranded_v2)
    assert warnings[0].startswith("warning: 2 command(s) of doctor_stranded v1 ")
    assert f"plan {v1.plan_hash[:12]}" in warnings[0] and "no worker that claimed them has this pin" in warnings[0]
    assert warnings[1].startswith("warning: 1 command(s) of doctor_stranded v2 ")
    assert f"plan {v2.plan_hash[:12]}" in warnings[1]
    assert "doctor_kept" not in result.stdout

    data = json.loads(doctor(database_url, "-o", "json").stdout)
    assert [(d["definition_id"], d["version"], d["plan_hash"], d["commands"], d["deferrals"])
            for d in data["deferred_pins"]] == [
        ("doctor_stranded", 1, v1.plan_hash, 2, 1),
        ("doctor_stranded", 2, v2.plan_hash, 1, 1),
    ]
    assert data["deferred_pins"][0]["oldest"] <= data["deferred_pins"][1]["oldest"]
    assert [w for w in data["warnings"] if "can alter schema" not in w] == [
        w.removeprefix("warning: ") for w in warnings + stranded]



def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_doctor_shows_the_broker_masked_and_whether_it_answers(database_url: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPSTONE_BROKER_URL", f"redis://:hunter2@127.0.0.1:{_closed_port()}/0")
    down = doctor(database_url, "-o", "json")
    assert down.exit_code == 0, down.output  # a broker that is down is a warning: events wait
    report = json.loads(down.stdout)
    assert "hunter2" not in down.stdout
    assert report["config"]["broker_url"]["source"] == "env STEPSTONE_BROKER_URL"
    assert report["broker"]["answers"] is False
    assert any("does not answer" in w for w in report["warnings"])
    text = doctor(database_url).stdout
    assert "broker_url" in text and "redis://:***@" in text and "hunter2" not in text
    assert re.search(r"^answers +no$", text, re.MULTILINE), text

    monkeypatch.setenv("STEPSTONE_BROKER_URL", "kafka://127.0.0.1:9092")
    unknown = doctor(database_url)
    assert unknown.exit_code == 1 and "no publisher for broker URL" in unknown.output


@pytest.mark.parametrize("env", ["STEPSTONE_TEST_REDIS_URL", "STEPSTONE_TEST_NATS_URL", "STEPSTONE_TEST_AMQP_URL"])
def test_doctor_sees_a_real_broker_answer(database_url: str, monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    url = os.environ.get(env)
    if not url:
        pytest.skip(f"{env} is not set (no broker of that kind on this machine)")
    monkeypatch.setenv("STEPSTONE_BROKER_URL", url)
    result = doctor(database_url, "-o", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["broker"]["answers"] is True, report["broker"]
    assert [w for w in report["warnings"] if "can alter schema" not in w] == []


def test_doctor_warns_of_a_moved_database_clock(database_url: str) -> None:
    async def move(seconds: float) -> None:
        store = await PostgresStore.open(database_url)
        try:
            await store.move_clock(seconds)
        finally:
            await store.close()

    calm = json.loads(doctor(database_url, "-o", "json").stdout)
    assert calm["database"]["clock_offset_seconds"] == 0
    assert not any("clock" in w for w in calm["warnings"])
    asyncio.run(move(3 * 86_400))
    result = doctor(database_url)
    assert result.exit_code == 0, result.output  # a warning, not a problem
    assert "warning: the database clock (db_now()) is +259200 s (+3.00 days) off the server's" in result.stdout
    assert json.loads(doctor(database_url, "-o", "json").stdout)["database"]["clock_offset_seconds"] == 3 * 86_400
