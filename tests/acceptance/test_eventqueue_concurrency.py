"""Handlers that do real work, in worker processes: calls side by side within a worker and across workers, each
key's limit and order kept, a call past its deadline holding its event until it ends, user code that exits or
holds the GIL failing its event only, and a killed worker's events back within its lease's TTL."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from eq_runs import EQ_RUNS, left, runs
from intervals import most_at_once
from processes import stop
from waiting import wait_until

from cmb_dagster.eventqueue import emit_many, register

HERE = Path(__file__).parent
CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]
WORKER = [*CLI, "events", "worker", "--handlers", "eventqueue_concurrency_handlers:registry", "--sweep-interval", "0.5"]


@pytest.fixture(autouse=True)
def handlers_importable(monkeypatch, db):
    monkeypatch.syspath_prepend(str(HERE))
    import eventqueue_concurrency_handlers

    register(db, eventqueue_concurrency_handlers.registry)
    with db.connection() as conn:
        conn.execute(EQ_RUNS)


def start_workers(database_url: str, n: int, *args: str, **env: str) -> list[subprocess.Popen]:
    environment = {
        **os.environ,
        "CMB_DATABASE_URL": database_url,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        **env,
    }
    return [
        subprocess.Popen([*WORKER, *args], env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(n)
    ]


def emit(db, handler: str, values: list[dict]) -> list[int]:
    return emit_many([{"namespace": "ns", "handler": handler, "value": v} for v in values], db=db)


def dead(db) -> dict[int, str]:
    with db.connection() as conn:
        return dict(conn.execute("SELECT id, error FROM eventqueue_dead").fetchall())


def intervals_of(done: list[tuple], key: str | None = None) -> list[tuple[float, float]]:
    return [(s, e if e is not None else float("inf")) for _, k, _, s, e in done if key is None or k == key]


def test_keys_at_concurrency_1_run_side_by_side_across_three_workers_each_in_order(db, database_url):
    ids = emit(db, "one_per_key", [{"tenant": t, "n": n} for n in range(8) for t in "abcd"])
    procs = start_workers(database_url, 3, EQ_SLEEP="0.2")
    try:
        wait_until(lambda: left(db) == 0, timeout=120, what="every event processed", interval=0.2)
    finally:
        stop(procs)
    done = runs(db)
    assert sorted(r[0] for r in done) == ids  # each once
    assert most_at_once(intervals_of(done)) >= 3  # keys side by side
    for key in "abcd":
        assert most_at_once(intervals_of(done, key)) == 1, key
        started = [r[0] for r in done if r[1] == key]
        assert started == sorted(started), f"{key} started out of emission order: {started}"


def test_at_concurrency_2_a_key_never_runs_more_than_two_and_starts_in_emission_order(db, database_url):
    ids = emit(db, "two_per_key", [{"tenant": t, "n": n} for n in range(10) for t in "abcd"])
    procs = start_workers(database_url, 3, EQ_SLEEP="0.2")
    try:
        wait_until(lambda: left(db) == 0, timeout=120, what="every event processed", interval=0.2)
    finally:
        stop(procs)
    done = runs(db)
    assert sorted(r[0] for r in done) == ids
    for key in "abcd":
        assert most_at_once(intervals_of(done, key)) <= 2, key
        started = [r[0] for r in done if r[1] == key]
        assert started == sorted(started), f"{key} started out of emission order: {started}"
    assert most_at_once(intervals_of(done)) >= 4


def test_a_call_past_its_timeout_holds_its_key_until_it_ends(db, database_url):
    """A sync handler cannot be stopped: the event, its lock and its slot stay held until the call ends; it then
    fails as timed out and is retried, never beside the key's next event or another copy of itself."""
    slow, quick = emit(db, "one_per_key_1s", [{"tenant": "a", "sleep": 2.5}, {"tenant": "a", "sleep": 0.1}])
    procs = start_workers(database_url, 2)
    try:
        wait_until(lambda: left(db) == 0, timeout=120, what="both events settled", interval=0.2)
    finally:
        stop(procs)
    done = runs(db)
    assert most_at_once(intervals_of(done, "a")) == 1, done
    assert [r[0] for r in done].count(slow) == 2  # ran past its timeout, retried once, then dead-lettered
    assert "TimedOut" in dead(db)[slow]
    assert quick not in dead(db)


def kill_running_then_finish_on_another(db, database_url: str, calls: int, *args: str) -> None:
    """A worker (``args``) is killed once ``calls`` calls run; the events, their sleep cut to 0, are done by a second
    worker within a minute: the lease TTL and a sweep, far within the 300 s lock expiry and slot time to live."""
    first = start_workers(database_url, 1, *args, EQ_LOCK_EXPIRY="300")
    try:
        wait_until(lambda: len(runs(db)) == calls, timeout=60, what=f"{calls} calls running", interval=0.05)
        first[0].send_signal(signal.SIGKILL)
        first[0].wait(10)
        with db.connection() as conn:
            conn.execute("UPDATE eventqueue_events SET value = value || '{\"sleep\": 0}'")
        second = start_workers(database_url, 1, EQ_LOCK_EXPIRY="300")
        try:
            wait_until(lambda: left(db) == 0, timeout=60, what="the killed worker's events done", interval=0.2)
        finally:
            stop(second)
    finally:
        stop(first)


def test_a_killed_workers_events_run_again_within_its_lease_ttl_not_their_lock_expiry(db, database_url):
    ids = emit(db, "plain", [{"n": n, "sleep": 0.1} for n in range(5)])
    with db.connection() as conn:  # the first worker's calls hang until it is killed
        conn.execute("UPDATE eventqueue_events SET value = value || '{\"sleep\": 600}'")
    kill_running_then_finish_on_another(db, database_url, 5, "--worker-concurrency", "10")
    assert sorted(r[0] for r in runs(db) if r[4] is not None) == ids  # each done once after the kill


def test_a_killed_workers_slot_is_free_within_its_lease_ttl_not_the_slots_own(db, database_url):
    """The concurrency slot a killed worker held for its call is freed with its events, once its lease lapses, not
    when the slot's own 300 s time to live passes: the key's events run on another worker at once."""
    emit(db, "one_per_key", [{"tenant": "t", "sleep": 600}, {"tenant": "t", "sleep": 0}])
    kill_running_then_finish_on_another(db, database_url, 1)
    assert most_at_once(intervals_of(runs(db)[1:])) == 1  # the limit held: one call of the key at a time


def test_a_killed_worker_charges_a_crash_only_to_the_calls_that_ran(db, database_url):
    emit(db, "patient", [{"n": n, "sleep": 0.05} for n in range(400)])
    unfinished = (
        "SELECT id FROM eventqueue_events e WHERE {} AND NOT EXISTS"
        " (SELECT 1 FROM public.eq_runs r WHERE r.event_id = e.id AND r.ended_at IS NOT NULL)"
    )
    unlimited = ("--handlers", "eventqueue_concurrency_handlers:unlimited")
    [worker] = start_workers(database_url, 1, *unlimited, "--worker-concurrency", "2", EQ_LOCK_EXPIRY="300")

    def stopped_with_events_waiting() -> bool:
        """Stop the worker at a moment it holds more events than its two slots (claimed ahead, not started)."""
        worker.send_signal(signal.SIGSTOP)
        with db.connection() as conn:
            if len(conn.execute(unfinished.format("e.locked_by IS NOT NULL")).fetchall()) > 2:
                return True
        worker.send_signal(signal.SIGCONT)
        return False

    try:
        wait_until(stopped_with_events_waiting, timeout=60, what="events claimed ahead of the slots", interval=0.02)
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
    finally:
        stop([worker])
    with db.connection() as conn:
        charged = conn.execute(unfinished.format("e.crashes > 0")).fetchall()
    assert len(charged) <= 2, f"{len(charged)} unfinished events charged a crash: only the two calls that ran"


def test_a_handler_calling_sys_exit_fails_its_event_and_the_worker_goes_on(db, database_url):
    values = [{"n": n, "sleep": 0.05} for n in range(10)]
    values[3]["exit"] = True
    ids = emit(db, "plain", values)
    procs = start_workers(database_url, 1)
    try:
        wait_until(lambda: left(db) == 0, timeout=60, what="every event settled", interval=0.2)
        more = emit(db, "plain", [{"n": 10}])
        wait_until(lambda: left(db) == 0, timeout=60, what="an event emitted after it done", interval=0.2)
        assert procs[0].poll() is None, "the worker stopped"
    finally:
        stop(procs)
    assert list(dead(db)) == [ids[3]]
    assert "SystemExit" in dead(db)[ids[3]]
    assert sorted(r[0] for r in runs(db) if r[4] is not None) == sorted(set(ids + more) - {ids[3]})


def test_with_process_isolation_a_call_holding_the_gil_is_killed_at_its_timeout_and_the_lease_never_lapses(
    db, database_url
):
    [stuck] = emit(db, "plain", [{"gil": True}])
    procs = start_workers(database_url, 1, "--isolation", "process")
    try:
        wait_until(lambda: runs(db), timeout=60, what="the call holding the GIL started", interval=0.05)
        others = emit(db, "plain", [{"n": n, "sleep": 0.05} for n in range(20)])
        deadline = time.monotonic() + 12  # past the lease's 10 s TTL
        while time.monotonic() < deadline:
            with db.connection() as conn:
                lapsed = conn.execute(
                    "SELECT count(*) FROM leases WHERE kind = 'eventqueue.worker' AND expires_at <= now()"
                ).fetchone()[0]
            assert lapsed == 0, "the worker's lease lapsed"
            time.sleep(0.2)
        wait_until(lambda: left(db) == 0, timeout=60, what="every event settled", interval=0.2)
        assert procs[0].poll() is None
    finally:
        stop(procs)
    assert "TimedOut" in dead(db)[stuck] and "killed" in dead(db)[stuck]
    assert sorted(r[0] for r in runs(db) if r[4] is not None) == others
