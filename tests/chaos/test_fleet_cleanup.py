"""A chaos test that fails before it stops its fleet leaves its worker processes running and their logs
open; the next test in the same pytest process then errored on the collector's ResourceWarnings ("subprocess
... is still running", "unclosed file ... worker-4.log"). The autouse fixture `_no_fleet_left_running`
(tests/conftest.py) stops every fleet left running after each test."""

from __future__ import annotations

from pathlib import Path

from tests.chaos.rig import fleet as fleet_module
from tests.chaos.rig.fleet import Fleet


def test_a_fleet_left_running_is_stopped_with_its_logs_closed(database_url: str, tmp_path: Path) -> None:
    fleet = Fleet(database_url, tmp_path, 2, lease=1.0, concurrency=1, poll=0.2)
    fleet.start()
    procs = list(fleet.procs.values())
    assert all(p.popen.poll() is None for p in procs)
    fleet_module.stop_every_fleet()  # what the fixture does after a test that raised before fleet.stop()
    assert [p.popen.returncode is not None for p in procs] == [True, True]
    assert [p.out.closed for p in procs] == [True, True]
    assert fleet.procs == {}
    fleet_module.stop_every_fleet()  # nothing left: a second call stops nothing
