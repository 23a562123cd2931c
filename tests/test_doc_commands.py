"""Every shell block of README.md and docs/*.md runs as written, after the README's quick start.

Fences:
    ```sh       run: the runnable blocks of one file run in order in one bash session (so a block can
                use a variable an earlier one set), with the virtualenv's bin first on PATH (the quick
                start activates it) and STEPSTONE_DATABASE_URL set to a fresh migrated test database
    ```console  a transcript (a prompt and its output), not a script: never run
    ```python / ```text / ```toml ...  not shell
A ``sh`` block that must not run (it installs, runs for minutes, or until stopped) is preceded by an
``<!-- not run: why -->`` line. A fence without a language is refused, so nothing escapes by omission.

A block that serves HTTP names its port (``--port 8765``) so a reader can copy it; the test runs it on a
free port instead (``--port N`` and ``:N`` in that file's runnable blocks), so two suites on one machine
never answer each other's requests.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\S*)\s*$")
_NOT_RUN = re.compile(r"^<!--\s*not run:\s*(\S.*?)\s*-->\s*$")
_PORT_OPTION = re.compile(r"--(?:metrics-)?port[ =](\d+)\b")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    not_run: str | None  # the reason given, when marked

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    n = 0
    while n < len(lines):
        match = _FENCE.match(lines[n])
        if match is None:
            n += 1
            continue
        start = n
        end = next(i for i in range(n + 1, len(lines)) if lines[i].startswith("```"))
        marker = _NOT_RUN.match(lines[start - 1]) if start else None
        found.append(Block(path, start + 1, match.group(1), "\n".join(lines[start + 1:end]),
                           marker.group(1) if marker else None))
        n = end + 1
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def on_free_ports(text: str, free_port: Callable[[], int] = _free_port) -> str:
    """The blocks' text with each port given to ``--port``/``--metrics-port`` moved to a free one,
    wherever it is passed (``--port N``) or addressed (``:N``)."""
    for port in dict.fromkeys(_PORT_OPTION.findall(text)):
        text = re.sub(rf"(?:(?<=--port )|(?<=--port=)|(?<=--metrics-port )|(?<=--metrics-port=)|(?<=:))"
                      rf"{port}(?!\d)", str(free_port()), text)
    return text


def _script(runnable: list[Block]) -> str:
    parts = [
        "set -euo pipefail",
        # A block may start a worker in the background, as a user would; stop it when the file is done.
        "trap 'jobs -p | xargs -r kill 2>/dev/null; wait' EXIT",
    ]
    for block in runnable:
        parts += [f"echo '>>> block {block.where}' >&2", block.text]
    return on_free_ports("\n".join(parts) + "\n")


def test_every_fence_has_a_language_and_every_marker_a_reason() -> None:
    for path in DOCS:
        for block in blocks(path):
            assert block.lang, f"{block.where}: a fence without a language (sh, console, python, text, ...)"
            if block.not_run is not None:
                assert block.lang == "sh", f"{block.where}: only sh blocks need a not-run marker"


def test_the_block_parser_sees_markers(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("a\n```sh\necho 1\n```\n<!-- not run: takes an hour -->\n```sh\nsleep 3600\n```\n"
                   "```console\n$ x\n```\n")
    found = blocks(doc)
    assert [(b.lang, b.text, b.not_run) for b in found] == [
        ("sh", "echo 1", None), ("sh", "sleep 3600", "takes an hour"), ("console", "$ x", None)]


def test_served_ports_are_moved_to_free_ones() -> None:
    ports = iter([50001, 50002])
    text = ("stepstone serve --port 8765 &\ncurl localhost:8765/x http://127.0.0.1:8765/y\n"
            "stepstone worker --metrics-port=9464 && curl :9464/metrics; echo 87650 18765 port 8765")
    assert on_free_ports(text, lambda: next(ports)) == (
        "stepstone serve --port 50001 &\ncurl localhost:50001/x http://127.0.0.1:50001/y\n"
        "stepstone worker --metrics-port=50002 && curl :50002/metrics; echo 87650 18765 port 8765")


# First pass only: the blocks drive the CLI and the HTTP API, whose SQL the store's own tests run against
# each server; running every document again against a second PostgreSQL cost four minutes of CI.
@pytest.mark.first_pass_only
@pytest.mark.parametrize("path", [p for p in DOCS if any(b.lang == "sh" and b.not_run is None
                                                         for b in blocks(p))],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_shell_blocks_run_as_written(path: Path, database_url: str) -> None:
    runnable = [b for b in blocks(path) if b.lang == "sh" and b.not_run is None]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSTONE_") and k != "DATABASE_URL"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the active virtualenv
    env["STEPSTONE_DATABASE_URL"] = database_url
    with tempfile.TemporaryDirectory(prefix="stepstone-docs-") as cwd:  # nothing written into the clone
        proc = subprocess.Popen(["bash", "-c", _script(runnable)], cwd=cwd, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            with contextlib.suppress(ProcessLookupError):  # a block that hangs takes its children along
                os.killpg(proc.pid, signal.SIGKILL)
    last = [line for line in stderr.splitlines() if line.startswith(">>> block ")]
    assert proc.returncode == 0, (
        f"{last[-1] if last else path} failed (exit {proc.returncode}):\n"
        f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
    )
