"""Event queue worker processes: exactly once with 4 workers, at least once across kill -9, the CLI."""

import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from processes import stop
from waiting import wait_until

from cmb_dagster.eventqueue import emit_many, register

HERE = Path(__file__).parent
CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]
WORKER = [*CLI, "events", "worker", "--handlers", "eventqueue_handlers:registry", "--sweep-interval", "0.5"]


def env_for(database_url: str, out: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "CMB_DATABASE_URL": database_url,
        "EQ_OUT": str(out),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        **extra,
    }


def runs(out: Path) -> dict[int, list[tuple[float, int]]]:
    """event id -> [(time, pid)] of every handler run recorded."""
    found: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for path in out.glob("*.log"):
        pid = int(path.stem)
        for line in path.read_text().splitlines():
            event_id, at = line.split()
            found[int(event_id)].append((float(at), pid))
    return found


def left(db) -> int:
    with db.connection() as conn:
        return conn.execute("SELECT count(*) FROM eventqueue_events").fetchone()[0]


def again(out: Path, ran: set[int]) -> set[int]:
    """The events of ``ran`` that ran more than once."""
    return {i for i, v in runs(out).items() if i in ran and len(v) > 1}


def pending(db) -> set[int]:
    with db.connection() as conn:
        return {r[0] for r in conn.execute("SELECT id FROM eventqueue_events")}


def running_a_batch(procs: list[subprocess.Popen], out: Path) -> list[subprocess.Popen]:
    """The live workers that recorded a handler run in the last 50 ms."""
    now = time.time()
    logs = {p: out / f"{p.pid}.log" for p in procs if p.poll() is None}
    return [p for p, log in logs.items() if log.exists() and now - log.stat().st_mtime < 0.05]


def emit_all(db, n: int) -> list[int]:
    import eventqueue_handlers

    register(db, eventqueue_handlers.registry)
    return emit(db, n)


def emit(db, n: int) -> list[int]:
    """``n`` events for the registered handler ``record``."""
    ids = []
    for start in range(0, n, 1000):
        ids += emit_many(
            [{"namespace": "ns", "handler": "record", "value": i} for i in range(start, start + 1000)], db=db
        )
    return ids


@pytest.fixture(autouse=True)
def handlers_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


@pytest.mark.slow
def test_four_workers_process_10000_events_exactly_once(db, database_url, tmp_path):
    ids = emit_all(db, 10_000)
    env = env_for(database_url, tmp_path)
    procs = [subprocess.Popen(WORKER, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(4)]
    try:
        wait_until(lambda: left(db) == 0, timeout=120, what="every event processed", interval=0.2)
    finally:
        stop(procs)
    seen = runs(tmp_path)
    assert sorted(seen) == sorted(ids)
    assert max(len(v) for v in seen.values()) == 1  # exactly once
    assert len({pid for v in seen.values() for _, pid in v}) >= 2  # the work was shared


@pytest.mark.slow
def test_kill_9_workers_repeatedly_loses_nothing_and_lock_expiry_bounds_the_delay(db, database_url, tmp_path):
    lock_expiry = 2.0
    ids = emit_all(db, 10_000)
    # a batch is mostly handler time
    env = env_for(database_url, tmp_path, EQ_SLEEP="0.002", EQ_LOCK_EXPIRY=str(lock_expiry))
    command = [*WORKER, "--batch-size", "20"]
    procs = [subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(4)]
    kills: list[tuple[float, int]] = []
    ran: list[set[int]] = []  # per kill, the events its victim had run
    rng = random.Random(13)

    def kill_one() -> None:
        done = sum(len(v) for v in runs(tmp_path).values())
        wait_until(
            lambda: sum(len(v) for v in runs(tmp_path).values()) >= done + 300,
            timeout=60,
            what="progress before the next kill",
            interval=0.05,
        )
        wait_until(
            lambda: running_a_batch(procs, tmp_path), timeout=30, what="a worker running a batch", interval=0.005
        )
        victim = rng.choice(running_a_batch(procs, tmp_path))  # killed mid-batch: its runs are not committed
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        kills.append((time.time(), victim.pid))
        ran.append({i for i, v in runs(tmp_path).items() if victim.pid in {pid for _, pid in v}})
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def in_flight() -> set[int]:
        """The events a killed worker had run and not committed: they ran again."""
        return set().union(*(again(tmp_path, r) for r in ran))

    try:
        for _ in range(3):
            kill_one()
        wait_until(lambda: left(db) == 0, timeout=120, what="every event processed", interval=0.2)
        # on a loaded machine the worker picked may have committed between the look at its log and the kill:
        # then more events, and more kills (three at most) until one caught a batch in flight
        while not in_flight() and len(kills) < 6:
            ids += emit(db, 2000)  # the handlers stay as the workers registered them
            kill_one()
            wait_until(lambda: left(db) == 0, timeout=120, what="every event processed", interval=0.2)
    finally:
        stop(procs)
    assert left(db) == 0
    seen = runs(tmp_path)
    assert set(ids) <= set(seen)  # every event processed at least once
    killed = {pid for _, pid in kills}
    duplicated = {i: v for i, v in seen.items() if len(v) > 1}
    assert in_flight() and in_flight() == set(duplicated)  # the batches in flight at the kills ran again
    assert len(duplicated) <= len(kills) * 20  # and only those (one batch of 20 at most per kill)
    print(f"{len(duplicated)} events ran twice after {len(kills)} kills")
    # the backlog every other event was in: all were emitted before the run, so all were due before any
    # expired lock; the last of them ran at drained_at
    drained_at = max(min(v)[0] for i, v in seen.items() if i not in duplicated)
    for attempts in duplicated.values():
        attempts.sort()
        first_at, first_pid = attempts[0]
        assert first_pid in killed  # only events in flight in a killed worker ran twice
        kill_at = min(at for at, pid in kills if pid == first_pid)
        assert first_at <= kill_at
        # taken over no sooner than the lock expiry after the claim (never early) ...
        assert attempts[1][0] - first_at >= lock_expiry - 0.5
        # ... and then in line by the time its lock expired: no later than the expiry, or than the backlog
        # that was due before it, allows
        assert attempts[1][0] <= max(kill_at + lock_expiry, drained_at) + 3


def cli(*args: str, url: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "events", *args], env=env_for(url, tmp_path), capture_output=True, text=True, timeout=60, check=False
    )


def test_cli_emit_status_pause_dead_replay_and_one_line_errors(db, database_url, tmp_path):
    registered = cli("register", "--handlers", "eventqueue_handlers:registry", url=database_url, tmp_path=tmp_path)
    assert registered.returncode == 0
    bad = cli("emit", "ns", "nope", "1", url=database_url, tmp_path=tmp_path)
    assert bad.returncode == 1 and "handler: no handler named 'nope'" in bad.stderr and "Traceback" not in bad.stderr
    bad = cli("emit", "ns", "record", "{oops", url=database_url, tmp_path=tmp_path)
    assert bad.returncode == 1 and "value: not valid JSON" in bad.stderr
    bad = cli("emit", "ns", "record", "1", "--delay", "-3", url=database_url, tmp_path=tmp_path)
    assert bad.returncode == 2 and "Invalid value for '--delay'" in bad.stderr and "Traceback" not in bad.stderr
    bad = cli("replay", "999", url=database_url, tmp_path=tmp_path)
    assert bad.returncode == 1 and "ids: event 999 is not in the dead-letter table" in bad.stderr
    paused = cli("pause", "ns", "record", url=database_url, tmp_path=tmp_path)
    assert paused.stdout.startswith("paused ns/record/worker")
    recorded = int(cli("emit", "ns", "record", '{"a": 1}', url=database_url, tmp_path=tmp_path).stdout)
    failing = int(cli("emit", "ns", "always_fails", '"x"', url=database_url, tmp_path=tmp_path).stdout)
    worker = cli(
        "worker",
        "--handlers",
        "eventqueue_handlers:registry",
        "--duration",
        "2",
        "--sweep-interval",
        "0.1",
        url=database_url,
        tmp_path=tmp_path,
    )
    assert worker.returncode == 0, worker.stderr
    assert recorded not in runs(tmp_path)  # paused
    status = cli("status", url=database_url, tmp_path=tmp_path).stdout
    assert "pause ns/worker" in status
    dead = cli("dead", url=database_url, tmp_path=tmp_path).stdout
    assert f"{failing} ns/always_fails" in dead and "ValueError: cannot handle x" in dead
    assert "1 held events released" in cli("unpause", "ns", "record", url=database_url, tmp_path=tmp_path).stdout
    assert cli("replay", "--all", url=database_url, tmp_path=tmp_path).stdout.strip() == "replayed 1 events"
    worker = cli(
        "worker",
        "--handlers",
        "eventqueue_handlers:registry",
        "--duration",
        "1",
        "--sweep-interval",
        "0.1",
        url=database_url,
        tmp_path=tmp_path,
    )
    assert worker.returncode == 0
    assert len(runs(tmp_path)[recorded]) == 1
    assert f"{failing} ns/always_fails" in cli("dead", url=database_url, tmp_path=tmp_path).stdout  # failed again
