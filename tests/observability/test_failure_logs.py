"""The worker logs what fails, once each: a failed attempt that will be retried (WARNING), an instance that
failed, its retries spent or its command dead-lettered (ERROR); nothing for a step that succeeds."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from stepstone.observability.logs import JsonFormatter
from stepstone.testing import Engine
from tests.crashes import die_alone
from tests.observability import workflows
from tests.observability.workflows import traced, wobbly


@pytest.fixture
def logged() -> Iterator[list[dict[str, object]]]:
    """The worker's lines at WARNING and above, as --log-format json writes them (formatted as logged)."""
    records: list[dict[str, object]] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(json.loads(self.format(record)))

    handler = Capture(logging.WARNING)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("stepstone")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


async def test_a_retry_and_a_failed_instance_are_logged_once_each(
    engine: Engine, logged: list[dict[str, object]]
) -> None:
    ok = await engine.client.start(wobbly, {})
    retried = await engine.client.start(wobbly, {})
    failed = await engine.client.start(wobbly, {})
    workflows.FLAKY.update({retried: 1, failed: 5})
    for _ in range(3):
        await engine.advance(seconds=1)
    assert [(await engine.client.get(i)).status for i in (ok, retried, failed)] == ["COMPLETED", "COMPLETED",
                                                                                    "FAILED"]
    assert not [line for line in logged if line.get("instance") == ok]  # nothing for a step that succeeds
    step = {"workflow": "wobbly", "position": "", "step": "work"}
    [retry] = [line for line in logged if line.get("instance") == retried]
    assert retry == {**retry, **step, "attempt": 1, "level": "warning", "logger": "stepstone.worker"}
    assert "RuntimeError: wobble" in str(retry["message"]) and "retry" in str(retry["message"])
    first, last = [line for line in logged if line.get("instance") == failed]
    assert first == {**first, **step, "attempt": 1, "level": "warning"}
    assert last == {**last, **step, "attempt": 2, "level": "error", "logger": "stepstone.worker"}
    assert f"instance {failed} failed" in str(last["message"]) and "RuntimeError: wobble" in str(last["message"])


async def test_a_dead_letter_is_logged(engine: Engine, logged: list[dict[str, object]]) -> None:
    poison = await engine.client.start(traced, {})
    await die_alone(engine, lease=1)  # every claim dies before it settles, all but the first alone
    await engine.run_until_idle()
    assert (await engine.client.get(poison)).status == "FAILED"
    [line] = [line for line in logged if line.get("instance") == poison]
    assert line == {**line, "workflow": "traced", "position": "", "step": "first", "level": "error"}
    assert "ATTEMPTS_EXHAUSTED" in str(line["message"]) and "dead-lettered" in str(line["message"])
