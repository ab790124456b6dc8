"""A PgBouncer in transaction pooling mode in front of a test server, on 127.0.0.1 and a free port."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict, make_conninfo
from waiting import wait_until

USER = "postgres"
"""PgBouncer refuses to run as root: it runs as this user (the system's Postgres user), or, for a server on a unix
socket, as the owner of the socket's directory (the embedded server's is private to its user)."""


def unavailable_reason() -> str | None:
    """Why no PgBouncer can be started here, or None."""
    if shutil.which("pgbouncer") is None:
        return "the pgbouncer binary is not installed (Debian: apt-get install pgbouncer)"
    if os.geteuid() != 0:
        return "the test runs pgbouncer as the server's user, which needs root"
    return None


def _user_for(server: dict[str, str]) -> str:
    host = server.get("host") or ""
    if host.startswith("/"):
        owner = pwd.getpwuid(os.stat(host).st_uid).pw_name
        if owner != "root":
            return owner
    return USER


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgBouncer:
    """``pgbouncer`` for the server of ``server_url`` (every database of it), with ``pool_size`` server connections
    per database and user, in ``pool_mode``; :meth:`url` is a database's URL through it."""

    def __init__(self, server_url: str, *, pool_size: int = 2, pool_mode: str = "transaction") -> None:
        self.server = conninfo_to_dict(server_url)
        self.pool_size = pool_size
        self.pool_mode = pool_mode
        self.port = _free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="cmb-pgbouncer-"))
        self._proc: subprocess.Popen | None = None

    def url(self, dbname: str) -> str:
        """The URL of database ``dbname`` through the pooler."""
        user = self.server.get("user") or USER
        return f"postgresql://{user}@127.0.0.1:{self.port}/{dbname}"

    def __enter__(self) -> PgBouncer:
        target = {k: self.server[k] for k in ("host", "port", "user", "password") if self.server.get(k)}
        user = target.get("user", USER)
        (self._dir / "users.txt").write_text(f'"{user}" "{target.get("password", "")}"\n')
        (self._dir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = {make_conninfo(**target)}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self._dir / 'users.txt'}\n"
            f"pool_mode = {self.pool_mode}\ndefault_pool_size = {self.pool_size}\nmin_pool_size = 0\n"
            "reserve_pool_size = 0\nmax_client_conn = 500\n"
            "server_reset_query = DISCARD ALL\nserver_check_delay = 0\n"
            f"idle_transaction_timeout = 0\nlogfile = {self._dir / 'log'}\n"
        )
        runner = pwd.getpwnam(_user_for(self.server))
        for path in [self._dir, *self._dir.iterdir()]:
            os.chown(path, runner.pw_uid, runner.pw_gid)
        self._proc = subprocess.Popen(
            ["pgbouncer", str(self._dir / "pgbouncer.ini")],
            user=runner.pw_uid,
            group=runner.pw_gid,
            extra_groups=[],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(self._listening, 10, f"pgbouncer listening on 127.0.0.1:{self.port} (log: {self._dir / 'log'})")
        return self

    def _listening(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            raise RuntimeError(f"pgbouncer exited with {self._proc.returncode}: {self.log()}")
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            return False
        return True

    def log(self) -> str:
        path = self._dir / "log"
        return path.read_text() if path.exists() else ""

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
