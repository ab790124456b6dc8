"""Zombie workers: a worker process stopped (SIGSTOP) mid-batch past its lease TTL, taken over, then resumed
(SIGCONT), calls no user code for the partitions it lost, its late commit is refused by the fence, and it goes
on working.

A slower job: runs with ``CMB_MULTIHOST=1`` (``make test-multihost``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest
from processes import stop
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient, CallbackSettings
from cmb_dagster.database import Database

pytestmark = pytest.mark.skipif(
    os.environ.get("CMB_MULTIHOST") != "1", reason="multi-host job: set CMB_MULTIHOST=1 (make test-multihost)"
)

CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]
TTL = 3


class Worker:
    """A worker process whose log goes to a file (read after the test's checks)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log_path = log
        self._log = log.open("w")
        self.proc = subprocess.Popen([*CLI, *args], env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid

    def owns(self, owner: str) -> bool:
        return owner.split(":")[1] == str(self.pid)  # default owner names: host:pid:suffix

    def signal(self, signum: int) -> float:
        self.proc.send_signal(signum)
        return time.time()

    @property
    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        stop([self.proc])
        self._log.close()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.close()


def start(workers: list[Worker], tmp_path: Path, args: list[str], env: dict[str, str]) -> Worker:
    worker = Worker(args, env, tmp_path / f"worker{len(workers)}.log")
    workers.append(worker)
    return worker


def leases(db: Database, kind: str) -> dict[str, tuple[str, int, float]]:
    """partition -> (owner, fence, seconds left) of every lease of ``kind``."""
    with db.connection() as conn:
        rows = conn.execute(
            "SELECT partition, owner, fence, extract(epoch FROM expires_at - now())::float8 FROM leases "
            "WHERE kind = %s",
            (kind,),
        ).fetchall()
    return {p: (owner, fence, left) for p, owner, fence, left in rows}


def held_by(db: Database, kind: str, worker: Worker) -> dict[str, int]:
    """partition -> fence of the unexpired leases ``worker`` holds."""
    return {p: fence for p, (owner, fence, left) in leases(db, kind).items() if worker.owns(owner) and left > 0}


def take_over(db: Database, kind: str, lost: dict[str, int], taker: Worker) -> bool:
    """Whether ``taker`` holds every partition of ``lost`` with a higher fence."""
    now = held_by(db, kind, taker)
    return all(now.get(p, 0) > fence for p, fence in lost.items())


# -- callbacks ---------------------------------------------------------------------------------------------------


class Receiver:
    """An HTTP receiver on 127.0.0.1 that answers each call after ``delay`` seconds and records which process
    sent it (the peer's port among the victim's connections), when it arrived and the event's key."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.victim: int | None = None
        self.calls: list[tuple[float, bool, str]] = []  # (arrived, from the victim, event key)
        self.in_flight_from_victim = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                arrived = time.time()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                from_victim = receiver.sent_by_victim(self.client_address[1])
                with receiver._lock:
                    receiver.calls.append((arrived, from_victim, body["event_key"]))
                    receiver.in_flight_from_victim += from_victim
                try:
                    time.sleep(receiver.delay)
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                finally:
                    with receiver._lock:
                        receiver.in_flight_from_victim -= from_victim

            def log_message(self, *args: object) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 256  # every worker's connections at once

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def sent_by_victim(self, port: int) -> bool:
        if self.victim is None:
            return False
        try:
            return any(c.laddr and c.laddr.port == port for c in psutil.Process(self.victim).net_connections("tcp"))
        except psutil.Error:
            return False

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def callback_status(db: Database) -> Counter:
    with db.connection() as conn:
        return Counter(dict(conn.execute("SELECT status, count(*) FROM callback_events GROUP BY status").fetchall()))


def test_callbacks_zombie_calls_nothing_of_the_buckets_it_lost(db, database_url, workers, tmp_path):
    receiver = Receiver(delay=0.3)
    events = 400
    kind = "callbacks.bucket"
    settings = CallbackSettings(lease_ttl=TTL, timeout=1, poll_interval=0.2, allowed_hosts=["127.0.0.1"])
    try:
        with CallbackClient(db, settings) as client:
            begin = datetime.now(UTC)
            client.create_many(
                [
                    {
                        "owner_client_id": "z",
                        "group_key": "g",
                        "event_key": f"k{i}",
                        "run_at": begin + timedelta(milliseconds=30 * i),
                        "cb_url": f"{receiver.url}/cb",
                        "retry": {"delay": 1},
                    }
                    for i in range(events)
                ]
            )
        with db.connection() as conn:
            bucket_of = dict(conn.execute("SELECT event_key, bucket_id::text FROM callback_events").fetchall())
        env = {**os.environ, "CMB_DATABASE_URL": database_url}
        args = ["callbacks", "worker", "--lease-ttl", str(TTL), "--timeout", "1", "--poll-interval", "0.2"]
        args += ["--no-materialize", "--allow-host", "127.0.0.1"]
        victim = start(workers, tmp_path, args, env)
        receiver.victim = victim.pid
        wait_until(lambda: held_by(db, kind, victim), 30, "the victim holds buckets")
        other = start(workers, tmp_path, args, env)
        wait_until(lambda: receiver.in_flight_from_victim > 0, 30, "a call of the victim in flight")
        stopped_at = victim.signal(signal.SIGSTOP)
        lost = held_by(db, kind, victim)
        assert lost, "the victim held no bucket when it was stopped"
        in_flight = {key for at, mine, key in receiver.calls if mine and at < stopped_at}
        try:
            wait_until(lambda: take_over(db, kind, lost, other), 30, "the other worker took the victim's buckets over")
        except AssertionError:
            with db.connection() as conn:
                rows = conn.execute(
                    "SELECT pid, state, wait_event_type, left(query, 60), pg_blocking_pids(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database()"
                ).fetchall()
            raise AssertionError(f"no takeover; sessions: {rows}") from None
        done_before = callback_status(db)["notified"]
        wait_until(lambda: callback_status(db)["notified"] > done_before + 10, 30, "the other worker moved on")
        resumed_at = victim.signal(signal.SIGCONT)
        wait_until(lambda: callback_status(db)["notified"] == events, 60, f"every event called ({callback_status(db)})")

        # the victim rejoins: alive, and it takes the buckets over when the other one stops
        assert victim.proc.poll() is None, victim.log
        stop([other.proc])
        wait_until(lambda: set(held_by(db, kind, victim)) >= set(lost), 30, "the victim holds buckets again")

        late = [key for at, mine, key in receiver.calls if mine and at >= resumed_at and bucket_of[key] in lost]
        assert late == [], f"the victim called {len(late)} events of buckets it had lost after it resumed"
        called = Counter(key for _, _, key in receiver.calls)
        assert set(called) == set(bucket_of)  # none lost
        again = {key for key in in_flight if bucket_of[key] in lost}
        # the calls on the wire when it stopped were completed by the receiver, and called again by the new holder
        assert all(called[key] >= 2 for key in again), {key: called[key] for key in again}
    finally:
        receiver.close()
