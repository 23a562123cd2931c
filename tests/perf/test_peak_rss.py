"""The memory bench reports a worker process's own peak, not the peak of the process that started it."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux keeps ru_maxrss across exec")


def test_a_child_reports_its_own_peak_not_its_parents() -> None:
    parent = bytearray(256 * 1024 * 1024)
    parent[::4096] = b"\x01" * (len(parent) // 4096)  # touch every page: resident
    out = subprocess.run(
        [sys.executable, "-c", "from stepstone.bench.worker_proc import peak_rss_kb; print(peak_rss_kb())"],
        capture_output=True, text=True, check=True,
    ).stdout
    del parent
    assert int(out) < 200 * 1024, f"the child reported {int(out) // 1024} MB: its parent's 256 MB or more"
