"""Flow control of the event queue across worker processes: a concurrency limit per key that a kill -9 does not
leak, and a rate limit per key, both held across workers."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from eq_runs import EQ_RUNS, left, runs
from intervals import most_at_once, most_within
from processes import stop
from waiting import wait_until

from cmb_dagster.eventqueue import emit_many, register

HERE = Path(__file__).parent
CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]
WORKER = [*CLI, "events", "worker", "--handlers", "eventqueue_handlers:registry", "--sweep-interval", "0.5"]


@pytest.fixture(autouse=True)
def handlers_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


@pytest.fixture
def runs_table(db):
    with db.connection() as conn:
        conn.execute(EQ_RUNS)


def start_workers(database_url: str, n: int, **extra: str) -> list[subprocess.Popen]:
    env = {
        **os.environ,
        "CMB_DATABASE_URL": database_url,
        "EQ_OUT": "/nonexistent",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        **extra,
    }
    return [subprocess.Popen(WORKER, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(n)]


def emit(db, handler: str, tenants: list[str]) -> None:
    import eventqueue_handlers

    register(db, eventqueue_handlers.registry)
    emit_many([{"namespace": "ns", "handler": handler, "value": {"tenant": t}} for t in tenants], db=db)


def db_now(db) -> float:
    with db.connection() as conn:
        return conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()[0]


def test_a_concurrency_limit_holds_across_workers_and_a_killed_holders_slot_returns_after_its_ttl(
    db, database_url, runs_table
):
    ttl = 3.0
    emit(db, "two_per_tenant", ["a"] * 40 + ["b"] * 10)
    procs = start_workers(database_url, 4, EQ_SLEEP="0.2", EQ_LOCK_EXPIRY=str(ttl))
    try:

        def at_the_limit() -> list[tuple]:  # two events of tenant a run at once; one of them still runs
            so_far = [r for r in runs(db) if r[1] == "a"]
            if most_at_once([(s, e or float("inf")) for _, _, _, s, e in so_far]) < 2:
                return []
            return [r for r in so_far if r[4] is None]

        running = wait_until(at_the_limit, timeout=60, what="tenant a at its limit, one run going", interval=0.01)
        victim = next(p for p in procs if p.pid == running[0][2])
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        killed_at = db_now(db)
        wait_until(lambda: left(db) == 0, timeout=120, what="every event processed", interval=0.2)
    finally:
        stop(procs)
    done = runs(db)
    for key in ("a", "b"):
        intervals = [(s, killed_at if e is None else e) for _, k, _, s, e in done if k == key]
        assert most_at_once(intervals) <= 2, key
    # the killed run's slot stays taken until its ttl: tenant a runs one at a time meanwhile, then two again
    alive = [(s, e) for _, k, pid, s, e in done if k == "a" and pid != victim.pid]
    meanwhile = [(max(s, killed_at), min(e, killed_at + ttl - 0.5)) for s, e in alive if e > killed_at]
    assert most_at_once([i for i in meanwhile if i[0] < i[1]]) <= 1
    killed_event = running[0][0]
    assert len([r for r in done if r[0] == killed_event]) == 2  # it ran again after its lock expired


def test_a_rate_limit_holds_across_workers_and_drains_at_the_rate(db, database_url, runs_table):
    """200 events at 20/s (``CMB_RATE_TEST_EVENTS=2000``: the full-size run, 100 s)."""
    rate, burst, events = 20, 20, int(os.environ.get("CMB_RATE_TEST_EVENTS", "200"))
    emit(db, "twenty_a_second", ["a"] * events + ["b"] * 20)
    procs = start_workers(database_url, 3)
    try:
        wait_until(lambda: left(db) == 0, timeout=60 + events / rate, what="every event processed", interval=0.2)
    finally:
        stop(procs)
    starts = sorted(s for _, k, _, s, _ in runs(db) if k == "a")
    assert len(starts) == events
    # no 1-second window holds more than rate + burst starts: a start is stamped when its call begins, a moment after
    # its token, so a call begun late may fall in the next window (2 of slack; without the limit it is all 200)
    assert most_within(starts, 1.0) <= rate + burst + 2
    ideal = (events - burst) / rate
    took = starts[-1] - starts[0]
    assert took >= ideal - 0.1, f"drained in {took:.2f} s, faster than the rate allows ({ideal:.2f} s)"
    print(f"{events} events at {rate}/s: drained in {took:.2f} s, ideal {ideal:.2f} s")
    b_starts = sorted(s for _, k, _, s, _ in runs(db) if k == "b")
    # another key has its own bucket: its 20, emitted after a's, all went while a's first half still waited
    assert b_starts[-1] < starts[events // 2], (b_starts, starts)


def test_a_debounced_batch_survives_a_kill_9_and_completes_once_as_a_whole(db, database_url, runs_table):
    import eventqueue_handlers

    register(db, eventqueue_handlers.registry)
    ids = emit_many(
        [{"namespace": "ns", "handler": "digest", "value": {"user": "u", "n": n}} for n in range(100)], db=db
    )
    procs = start_workers(database_url, 1, EQ_SLEEP="30", EQ_LOCK_EXPIRY="2")
    try:
        wait_until(lambda: runs(db), timeout=60, what="the batch called", interval=0.05)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        procs += start_workers(database_url, 1, EQ_SLEEP="0", EQ_LOCK_EXPIRY="2")
        wait_until(lambda: left(db) == 0, timeout=60, what="the batch done", interval=0.2)
    finally:
        stop(procs)
    calls = runs(db)
    assert len(calls) == 2  # the killed call, and once more after its lock expired
    assert {c[1] for c in calls} == {",".join(map(str, ids))}  # each time the whole batch, in order
    assert calls[1][4] is not None
