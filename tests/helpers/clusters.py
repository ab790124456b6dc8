"""Postgres clusters of Debian's PostgreSQL 15 binaries in directories of their own: a primary, a streaming
standby made with pg_basebackup, promotion, stop and start.

Each cluster listens on its own port on 127.0.0.1 and its own unix socket directory, under a directory named
after this process (so two test sessions never collide) and owned by the ``postgres`` user (the server refuses
to run as root). :func:`cluster_directory` removes everything it made, also on failure.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psycopg

BIN = Path("/usr/lib/postgresql/15/bin")
SERVER_USER = "postgres"
START_TIMEOUT_S = 60


def unavailable() -> str | None:
    """Why this machine cannot run the clusters (None: it can)."""
    if not (BIN / "pg_ctl").exists() or not (BIN / "pg_basebackup").exists():
        return f"PostgreSQL 15 server binaries missing in {BIN} (Debian's postgresql-15)"
    try:
        pwd.getpwnam(SERVER_USER)
    except KeyError:
        return f"no {SERVER_USER!r} user to run the servers as"
    if os.geteuid() != 0 and pwd.getpwuid(os.geteuid()).pw_name != SERVER_USER:
        return f"the servers run as {SERVER_USER!r}: needs root (runuser) or that user"
    if shutil.which("runuser") is None and os.geteuid() == 0:
        return "runuser missing (util-linux)"
    return None


def _as_server_user(*command: str | Path, timeout: float = START_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    argv = [str(c) for c in command]
    if os.geteuid() == 0:
        argv = ["runuser", "-u", SERVER_USER, "--", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=True, cwd="/")


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Cluster:
    """One Postgres cluster: data under ``root/name/data``, its socket in ``root/name/run``, its log beside."""

    def __init__(self, root: Path, name: str) -> None:
        self.name = name
        self.home = root / name
        self.data = self.home / "data"
        self.sockets = self.home / "run"
        self.log = self.home / "server.log"
        self.port = free_port()

    def url(self, dbname: str = "postgres") -> str:
        """A libpq URL of this server alone."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def _make_home(self) -> None:
        _as_server_user("mkdir", "-p", self.home, self.sockets)

    def _settings(self) -> str:
        return (
            f"\nlisten_addresses = '127.0.0.1'\nport = {self.port}\nunix_socket_directories = '{self.sockets}'\n"
            "max_connections = 300\nwal_level = replica\nmax_wal_senders = 5\nhot_standby = on\n"
            "fsync = off\nfull_page_writes = off\nwal_keep_size = '256MB'\n"
            "wal_sender_timeout = '5s'\nwal_receiver_status_interval = '1s'\n"
        )

    def initdb(self) -> Cluster:
        """A new cluster (trust authentication on 127.0.0.1 and the socket, replication allowed)."""
        self._make_home()
        _as_server_user(BIN / "initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8")
        self._append_settings()
        return self

    def _append_settings(self) -> None:
        conf = self.data / "postgresql.conf"
        _as_server_user("sh", "-c", f"cat >> '{conf}' <<'EOF'\n{self._settings()}\nEOF")

    def standby_of(self, primary: Cluster) -> Cluster:
        """This cluster as a streaming standby of ``primary``: a pg_basebackup with its recovery settings."""
        self._make_home()
        _as_server_user(
            BIN / "pg_basebackup",
            "-D",
            self.data,
            "-h",
            "127.0.0.1",
            "-p",
            str(primary.port),
            "-U",
            "postgres",
            "-X",
            "stream",
            "-R",  # standby.signal and primary_conninfo
            "--no-sync",
            "-c",
            "fast",
        )
        self._append_settings()  # its own port and socket, after the primary's copied ones
        _as_server_user("sh", "-c", f"echo \"cluster_name = '{self.name}'\" >> '{self.data}/postgresql.conf'")
        return self

    def start(self) -> Cluster:
        _as_server_user(BIN / "pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t", str(START_TIMEOUT_S), "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``immediate``: as a crash would, without a checkpoint)."""
        if (self.data / "postmaster.pid").exists():
            _as_server_user(BIN / "pg_ctl", "-D", self.data, "-w", "-m", mode, "stop")

    def promote(self) -> None:
        """End recovery: the standby becomes a primary (waits until it accepts writes)."""
        _as_server_user(BIN / "pg_ctl", "-D", self.data, "-w", "-t", str(START_TIMEOUT_S), "promote")

    def execute(self, statement: str, params: tuple = (), dbname: str = "postgres") -> list[tuple]:
        """Run one statement as the superuser (autocommit); its rows, if any."""
        with psycopg.connect(self.url(dbname), autocommit=True, connect_timeout=5) as conn:
            cursor = conn.execute(statement, params)
            return cursor.fetchall() if cursor.description else []

    def in_recovery(self) -> bool:
        return self.execute("SELECT pg_is_in_recovery()")[0][0]


def multihost_url(clusters: list[Cluster], dbname: str, *, key_value: bool = False) -> str:
    """A libpq URL naming every cluster, connecting to whichever accepts writes."""
    if key_value:
        hosts = ",".join("127.0.0.1" for _ in clusters)
        ports = ",".join(str(c.port) for c in clusters)
        return f"host={hosts} port={ports} user=postgres dbname={dbname} target_session_attrs=read-write"
    hosts = ",".join(f"127.0.0.1:{c.port}" for c in clusters)
    return f"postgresql://postgres@{hosts}/{dbname}?target_session_attrs=read-write"


@contextmanager
def cluster_directory() -> Iterator[Path]:
    """A directory the server user owns, named after this process; on exit every server under it is stopped
    (immediately) and the directory removed."""
    root = Path(tempfile.mkdtemp(prefix=f"cmb-clusters-{os.getpid()}-"))
    user = pwd.getpwnam(SERVER_USER)
    os.chown(root, user.pw_uid, user.pw_gid)
    root.chmod(0o755)
    try:
        yield root
    finally:
        for pid_file in root.glob("*/data/postmaster.pid"):
            with suppress(subprocess.SubprocessError):  # already stopped
                _as_server_user(BIN / "pg_ctl", "-D", pid_file.parent, "-w", "-m", "immediate", "stop")
        shutil.rmtree(root, ignore_errors=True)
