"""Worker "hosts" in Linux network namespaces, linked to a Postgres server in a namespace of its own.

Topology, per test session (names carry the test process's pid, so two runs cannot collide; ``k`` is a second
address octet derived from it):

- ``cmbpg<pid>``: Postgres, listening on every address of the namespace; linked to the root namespace (where the
  test runs) by ``10.k.0.1`` (root) / ``10.k.0.2`` (Postgres).
- ``cmbh<N><pid>``: worker host ``N`` (1, 2, ...), linked to Postgres by its own veth pair (``10.k.N.1`` host,
  ``10.k.N.2`` Postgres), and to the root namespace by another (``10.k.100+N.1`` host, ``10.k.100+N.2`` root), so
  it reaches a receiver the test runs at :attr:`Network.receiver_address` whether or not its database link is up.

:meth:`Network.cut` sets the Postgres end of a host's database link down: packets in either direction vanish
(nothing answers, nothing resets), as when a host drops off the network; :meth:`Network.heal` sets it up again.
Everything is made by ``ip`` (iproute2) as root and removed by :meth:`Network.close`, also after a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

PG_BIN = Path("/usr/lib/postgresql/15/bin")
PG_PORT = 5432


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("runuser") is None:
        return "iproute2's ip and runuser are needed"
    if not (PG_BIN / "postgres").exists():
        return f"PostgreSQL 15 binaries not found in {PG_BIN}"
    probe = f"cmbprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"ip netns add refused: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def ip(*args: str, netns: str | None = None) -> None:
    """Run ``ip args`` (in ``netns``); raise with its message if it fails."""
    command = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")


class Network:
    """The namespaces, links and Postgres server of one test session; a context manager that removes them."""

    def __init__(self, hosts: int) -> None:
        self.tag = str(os.getpid())
        self.octet = 20 + os.getpid() % 200
        self.pg_netns = f"cmbpg{self.tag}"
        self.hosts = list(range(1, hosts + 1))
        self._namespaces: list[str] = []
        self._links: list[tuple[str, str]] = []  # (namespace, interface) to delete
        self._pgdata: Path | None = None

    # -- names and addresses ---------------------------------------------------------------------

    def netns(self, host: int) -> str:
        return f"cmbh{host}{self.tag}"

    def pg_address(self, host: int | None = None) -> str:
        """Postgres's address as seen from ``host`` (None: from the root namespace)."""
        return f"10.{self.octet}.{host or 0}.2"

    def host_address(self, host: int) -> str:
        """``host``'s address on its database link (what Postgres sees as the client address)."""
        return f"10.{self.octet}.{host}.1"

    @property
    def receiver_address(self) -> str:
        """An address of the root namespace every host reaches over its side link (not through Postgres)."""
        return f"10.{self.octet}.101.2"

    def database_url(self, host: int | None = None, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@{self.pg_address(host)}:{PG_PORT}/{dbname}"

    def _db_link(self, host: int) -> str:
        return f"cmh{host}{self.tag}p"

    # -- building --------------------------------------------------------------------------------

    def __enter__(self) -> Network:
        try:
            self._add_netns(self.pg_netns)
            self._veth(f"cmr{self.tag}a", None, f"10.{self.octet}.0.1/30", f"cmr{self.tag}b", self.pg_netns, "0.2/30")
            for host in self.hosts:
                ns = self.netns(host)
                self._add_netns(ns)
                self._veth(f"cmh{host}{self.tag}h", ns, f"10.{self.octet}.{host}.1/30", self._db_link(host),
                           self.pg_netns, f"{host}.2/30")  # fmt: skip
                self._veth(f"cmx{host}{self.tag}h", ns, f"10.{self.octet}.{100 + host}.1/30", f"cmx{host}{self.tag}r",
                           None, f"{100 + host}.2/30")  # fmt: skip
                if host != 1:
                    ip("route", "add", f"{self.receiver_address}/32", "via", f"10.{self.octet}.{100 + host}.2",
                       netns=ns)  # fmt: skip
            self._start_postgres()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_netns(self, name: str) -> None:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)  # a leftover of a dead run
        ip("netns", "add", name)
        self._namespaces.append(name)
        ip("link", "set", "lo", "up", netns=name)

    def _veth(self, a: str, a_ns: str | None, a_addr: str, b: str, b_ns: str | None, b_suffix: str) -> None:
        """A veth pair ``a`` (in ``a_ns``, None: root) -- ``b`` (in ``b_ns``), both up with their addresses."""
        subprocess.run(["ip", "link", "del", a], capture_output=True, check=False)  # a leftover of a dead run
        ip("link", "add", a, "type", "veth", "peer", "name", b)
        self._links.append((None, a) if a_ns is None else (a_ns, a))  # type: ignore[arg-type]
        for name, ns, addr in ((a, a_ns, a_addr), (b, b_ns, f"10.{self.octet}.{b_suffix}")):
            if ns is not None:
                ip("link", "set", name, "netns", ns)
            ip("addr", "add", addr, "dev", name, netns=ns)
            ip("link", "set", name, "up", netns=ns)

    def _start_postgres(self) -> None:
        self._pgdata = Path(tempfile.mkdtemp(prefix=f"cmbmh{self.tag}-"))
        shutil.chown(self._pgdata, "postgres", "postgres")
        data = self._pgdata / "data"
        self._as_postgres(None, str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
        with (data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all 10.{self.octet}.0.0/16 trust\n")
        settings = {
            "listen_addresses": "'*'",
            "port": PG_PORT,
            "unix_socket_directories": f"'{self._pgdata}'",
            "max_connections": 200,
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
        }
        with (data / "postgresql.conf").open("a") as conf:
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())
        self._as_postgres(self.pg_netns, str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(self._pgdata / "log"),
                          "-w", "-t", "60", "start")  # fmt: skip

    def _as_postgres(self, netns: str | None, *command: str) -> None:
        prefix = ["ip", "netns", "exec", netns] if netns else []
        done = subprocess.run([*prefix, "runuser", "-u", "postgres", "--", *command], capture_output=True,
                              text=True, check=False, timeout=120)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} failed: {done.stdout}{done.stderr}")

    # -- using -----------------------------------------------------------------------------------

    def popen(self, host: int, command: Sequence[str], env: dict[str, str], **kwargs: object) -> subprocess.Popen:
        """Start ``command`` in ``host``'s namespace (``ip netns exec`` execs it: the Popen's pid is its pid)."""
        return subprocess.Popen(["ip", "netns", "exec", self.netns(host), *command], env=env, **kwargs)  # type: ignore[call-overload]

    def cut(self, host: int) -> float:
        """Take ``host``'s database link down; return the time (``time.time()``) it was down."""
        ip("link", "set", self._db_link(host), "down", netns=self.pg_netns)
        return time.time()

    def heal(self, host: int) -> float:
        """Bring ``host``'s database link up again; return the time it was up."""
        ip("link", "set", self._db_link(host), "up", netns=self.pg_netns)
        return time.time()

    def close(self) -> None:
        """Stop Postgres, delete the links and namespaces (what exists of them)."""
        if self._pgdata is not None:
            data = self._pgdata / "data"
            if (data / "postmaster.pid").exists():
                subprocess.run(["runuser", "-u", "postgres", "--", str(PG_BIN / "pg_ctl"), "-D", str(data), "-m",
                                "immediate", "-w", "stop"], capture_output=True, check=False, timeout=60)  # fmt: skip
            shutil.rmtree(self._pgdata, ignore_errors=True)
            self._pgdata = None
        for ns, link in reversed(self._links):
            subprocess.run(["ip", *(["-n", ns] if ns else []), "link", "del", link], capture_output=True, check=False)
        self._links.clear()
        for ns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self._namespaces.clear()
