"""Stopping `make dev` / `cmb-dagster dev`: every process gone within 20 s, worker runs end as successes.

Two ways a user stops it: Ctrl-C in the terminal (the terminal sends SIGINT to its foreground process
group) and SIGTERM to the process group of `make dev` (what a process manager does).
"""

import contextlib
import os
import pty
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psycopg
import pytest
from test_dev_command import answers, free_port
from test_dev_command import dev_env as dev_env  # a fixture
from waiting import wait_until

from cmb_dagster.embedded import embedded_url

ROOT = Path(__file__).resolve().parents[2]
STOP_WITHIN_S = 20
EMBEDDED_ONLY = pytest.mark.skipif(
    bool(os.environ.get("CMB_TEST_DATABASE_URL")),
    reason="how dev stops does not depend on the server: runs on the embedded one, as `make dev` does",
)
WORKER_KINDS = {"callbacks.bucket", "pubsub.consumer", "stages.shard", "eventqueue.worker"}  # the demo's workers


def session_processes(session: int) -> str:
    return subprocess.run(
        ["ps", "-o", "pid=,args=", "--sid", str(session)], capture_output=True, text=True
    ).stdout.strip()


def cmb_url(env: dict[str, str]) -> str:
    return env.get("CMB_DATABASE_URL") or embedded_url(Path(env["CMB_HOME"]))


def settled_runs(env: dict[str, str]) -> list[str]:
    """The worker runs and the runs that have ended: what a stop must leave as successes or as it found them.
    Another run starting at the moment of the stop (the reactive scheduler may launch one between the last
    check and the signal) is interrupted, as with plain `dagster dev`."""
    with psycopg.connect(cmb_url(env)) as conn:
        return [
            run_id
            for (run_id,) in conn.execute(
                "SELECT run_id FROM runs r WHERE status IN ('SUCCESS', 'FAILURE', 'CANCELED') "
                "OR EXISTS (SELECT FROM run_tags t WHERE t.run_id = r.run_id AND t.key = 'cmb/worker')"
            )
        ]


def run_statuses(env: dict[str, str], run_ids: list[str]) -> list[tuple[str, str]]:
    with psycopg.connect(cmb_url(env)) as conn:
        return conn.execute(
            "SELECT pipeline_name, status FROM runs WHERE run_id = ANY(%s) ORDER BY create_timestamp", (run_ids,)
        ).fetchall()


def workers_working(env: dict[str, str]) -> bool:
    """Every demo worker holds its lease, no run is starting, and no other run is in progress (a run that
    is starting or running its ops when dev stops is interrupted, as with plain `dagster dev`; the hourly
    trim schedule's run is one of them)."""
    with psycopg.connect(cmb_url(env)) as conn:
        kinds = {k for (k,) in conn.execute("SELECT kind FROM cmb.leases WHERE expires_at > now()")}
        busy = conn.execute(
            "SELECT pipeline_name FROM runs r WHERE status = 'STARTING' OR status = 'STARTED' AND NOT EXISTS "
            "(SELECT FROM run_tags t WHERE t.run_id = r.run_id AND t.key = 'cmb/worker')"
        ).fetchall()
    return kinds >= WORKER_KINDS and not busy


def wait_stopped(proc: subprocess.Popen, sessions: list[int]) -> None:
    """Wait for ``proc`` to exit; if it outlives the limit, fail naming what still runs in its sessions."""
    try:
        proc.wait(timeout=STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"still running {STOP_WITHIN_S} s after the stop:\n"
            + "\n".join(session_processes(s)[:2000] for s in sessions)
        ) from None


def check_stopped_cleanly(env: dict[str, str], sessions: list[int], settled: list[str]) -> None:
    """Every process gone, and the worker runs ended as successes: stopped by the signal, not killed at the end of
    `cmb-dagster dev`'s grace period."""
    try:
        wait_until(
            lambda: not any(session_processes(s) for s in sessions),
            STOP_WITHIN_S,
            "every process to stop",
            interval=0.2,
        )
    except AssertionError:
        raise AssertionError("left running:\n" + "\n".join(session_processes(s)[:2000] for s in sessions)) from None
    statuses = run_statuses(env, settled)
    assert not [r for r in statuses if r[1] in ("FAILURE", "CANCELED", "STARTED", "STARTING")], statuses
    assert ("cmb_callbacks_worker", "SUCCESS") in statuses


@pytest.fixture
def stop_env(dev_env):
    dev_env["DEV_ARGS"] = f"--port {free_port()} --sink-port {free_port()}"
    return dev_env


@EMBEDDED_ONLY
def test_sigterm_to_the_process_group_of_make_dev(stop_env):
    port = stop_env["DEV_ARGS"].split()[1]
    make = subprocess.Popen(
        ["make", "dev", f"PYTHON={sys.executable}"],
        cwd=ROOT,
        env=stop_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_until(lambda: answers(f"http://127.0.0.1:{port}/server_info"), 180, "the UI", interval=0.5)
        wait_until(lambda: workers_working(stop_env), 120, "worker runs to work", interval=1)
        sessions = [make.pid, *dagster_sessions(make.pid)]
        settled = settled_runs(stop_env)
        os.killpg(make.pid, signal.SIGTERM)
        wait_stopped(make, sessions)
        check_stopped_cleanly(stop_env, sessions, settled)
    finally:
        with_kill(make.pid)


@EMBEDDED_ONLY
def test_ctrl_c_in_a_terminal(stop_env):
    port = stop_env["DEV_ARGS"].split()[1]
    cli = [sys.executable, "-c", "from cmb_dagster.cli import run; run()", "dev", *stop_env["DEV_ARGS"].split()]
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        cli,
        cwd=ROOT,
        env=stop_env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        preexec_fn=lambda: _take_terminal(0),
    )
    os.close(slave)
    threading.Thread(target=_drain, args=(master,), daemon=True).start()  # the child never blocks on a full pty
    try:
        wait_until(lambda: answers(f"http://127.0.0.1:{port}/server_info"), 180, "the UI", interval=0.5)
        wait_until(lambda: workers_working(stop_env), 120, "worker runs to work", interval=1)
        sessions = [proc.pid, *dagster_sessions(proc.pid)]
        settled = settled_runs(stop_env)
        os.write(master, b"\x03")  # Ctrl-C: the terminal sends SIGINT to its foreground process group
        wait_stopped(proc, sessions)
        check_stopped_cleanly(stop_env, sessions, settled)
    finally:
        with_kill(proc.pid)


def dagster_sessions(pid: int) -> list[int]:
    """Sessions led by descendants of ``pid`` (`dagster dev` runs in a session of its own)."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,sid="], capture_output=True, text=True).stdout.split()
    rows = [tuple(map(int, out[i : i + 3])) for i in range(0, len(out), 3)]
    children: dict[int, list[int]] = {}
    for p, parent, _ in rows:
        children.setdefault(parent, []).append(p)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            found.append(child)
    return sorted({sid for p, _, sid in rows if p in found and sid == p})


def with_kill(group: int) -> None:
    for session in [group, *dagster_sessions(group)]:
        for line in session_processes(session).splitlines():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGKILL)


def _take_terminal(fd: int) -> None:
    import fcntl
    import termios

    fcntl.ioctl(fd, termios.TIOCSCTTY, 0)


def _drain(master: int) -> None:
    try:
        while os.read(master, 65536):
            pass
    except OSError:  # the terminal closed
        pass


# A process that says whether it had SIGINT ("interrupted") or was killed without one ("started").
LATE = """
import pathlib, sys, time
try:
    pathlib.Path(sys.argv[1]).write_text("started")
    time.sleep(120)
except KeyboardInterrupt:
    pathlib.Path(sys.argv[1]).write_text("interrupted")
"""
# A command that, on SIGINT, starts that process in its group (after ``STOPS_FOR`` seconds) and exits: what `dagster
# dev` does when a code server stopped before it did (it restarts the code server, which never had the signal).
LATE_STARTER = f"""
import pathlib, signal, subprocess, sys, time
STOPS_FOR = {{stops_for}}
marker, ready = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])

def start_late(signum, frame):
    time.sleep(STOPS_FOR)
    subprocess.Popen([sys.executable, "-c", {LATE!r}, str(marker)])
    while not marker.exists() or marker.read_text() != "started":
        time.sleep(0.05)
    sys.exit(0)

signal.signal(signal.SIGINT, start_late)
ready.touch()
time.sleep(120)
"""


def stop_under_run_process_group(script: str, marker: Path, ready: Path, grace_s: float | None = None) -> None:
    """Run ``script`` (given ``marker`` and ``ready``) under ``run_process_group``, optionally with another grace
    period; SIGTERM it once ``ready`` exists and wait for it to return 0."""
    setup = "" if grace_s is None else f"cli.STOP_GRACE_S = {grace_s}; "
    wrapper = (
        f"import os, sys; from cmb_dagster import cli; {setup}"
        "sys.exit(cli.run_process_group(sys.argv[1:], dict(os.environ)))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", wrapper, sys.executable, "-c", script, str(marker), str(ready)], start_new_session=True
    )
    try:
        wait_until(ready.exists, 30, "the command to start", interval=0.05)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        with_kill(proc.pid)


def test_a_process_started_in_the_group_after_the_stop_is_stopped_too(tmp_path):
    marker = tmp_path / "late"
    stop_under_run_process_group(LATE_STARTER.format(stops_for=0), marker, tmp_path / "ready")
    assert marker.read_text() == "interrupted"  # not killed at the end of the grace period


def test_what_is_left_is_killed_a_grace_period_after_the_signal_not_after_the_command(tmp_path):
    marker = tmp_path / "late"
    stop_under_run_process_group(LATE_STARTER.format(stops_for=3), marker, tmp_path / "ready", grace_s=1)
    # the command stopped for longer than the grace period: what it left was killed at once, not interrupted and
    # given a grace period of its own
    assert marker.read_text() == "started"
