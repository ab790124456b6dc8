"""A worker process's liveness endpoint (``--health-port``): 200 while its loops turn, 503 naming the loop once
one has not turned for ``--stall-after`` seconds, 200 again when it turns again."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from processes import stop
from waiting import wait_until

from cmb_dagster.database import Database

HERE = Path(__file__).parent
CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probe(port: int) -> tuple[int, str]:
    """(status, body) of GET /healthz, as a Kubernetes httpGet probe sends it; (0, reason) when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def test_a_worker_is_alive_while_its_loop_turns_and_stalled_while_it_is_stuck(database_url: str, db: Database):
    port = free_port()
    env = {
        **os.environ,
        "CMB_DATABASE_URL": database_url,
        "EQ_OUT": "/dev/null",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    args = ["events", "worker", "--handlers", "eventqueue_handlers:registry", "--sweep-interval", "0.2"]
    args += ["--health-port", str(port), "--stall-after", "2"]
    worker = subprocess.Popen([*CLI, *args], env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: probe(port) == (200, "ok\n"), 60, "the worker answers 200 once its loop runs")
        with db.connection() as conn:  # every lease statement of the worker now waits: its loop stops turning
            conn.execute("LOCK TABLE leases IN ACCESS EXCLUSIVE MODE")
            wait_until(lambda: probe(port)[0] == 503, 30, "the stuck worker answers 503")
            body = probe(port)[1]
            assert "eventqueue" in body, body
        wait_until(lambda: probe(port)[0] == 200, 30, "the worker answers 200 again once it turns")
        assert probe(port)[1] == "ok\n"
    finally:
        stop([worker])
    assert worker.returncode == 0, worker.stderr.read() if worker.stderr else ""
    assert probe(port)[0] == 0  # the endpoint ends with the worker
