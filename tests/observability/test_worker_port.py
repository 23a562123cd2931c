"""`stepstone worker --metrics-port --log-format json` as a real process: probes and metrics on the port,
one JSON object per log line, and a drain on SIGTERM."""

from __future__ import annotations

import json
import re
import signal

from tests.observability.test_metrics_health import _get
from tests.test_cli_worker import DEADLINE, start_worker


async def test_the_worker_serves_probes_and_metrics_and_logs_json(database_url: str) -> None:
    worker = await start_worker(database_url, "--metrics-port", "0", "--metrics-host", "127.0.0.1",
                                "--log-format", "json")
    try:
        line = await worker.line_containing("health and metrics on")
        record = json.loads(line)
        assert record["level"] == "info" and record["logger"] == "stepstone.cli.worker"
        match = re.search(r":(\d+) \(", record["message"])
        assert match is not None, record
        port = int(match.group(1))
        assert await _get(port, "/livez") == (200, '{"alive": true}')
        status, body = await _get(port, "/readyz")
        assert (status, json.loads(body)["ready"]) == (200, True)
        status, text = await _get(port, "/metrics")
        assert status == 200 and "stepstone_claims_total" in text
    finally:
        worker.proc.send_signal(signal.SIGTERM)
        assert await worker.exit_code(DEADLINE) == 0
    assert all(json.loads(raw) for raw in "".join(worker.lines).splitlines() if raw.strip())
