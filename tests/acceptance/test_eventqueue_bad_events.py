"""One slow or crashing event affects only itself: event queue worker processes run every other event, and
no finished event runs twice unless a worker died while it was in flight."""

import subprocess
import time
from pathlib import Path

import pytest
from test_eventqueue_processes import WORKER, env_for, left, runs, stop
from waiting import wait_until

from cmb_dagster.eventqueue import dead_letters, emit_many, register

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def handlers_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def emit_mixed(db, values: list[dict]) -> list[int]:
    import eventqueue_handlers

    register(db, eventqueue_handlers.registry)
    return emit_many([{"namespace": "ns", "handler": "mixed", "value": v} for v in values], db=db)


def test_no_finished_event_runs_twice_with_slow_handlers_in_its_batch(db, database_url, tmp_path):
    """Locks last 1 s; a batch holds calls of 1.5 s and one of 4 s: finished events are deleted before
    their locks lapse, and the locks of the events still running or waiting are renewed."""
    values = [{"sleep": 4.0 if i == 10 else 1.5 if i % 25 == 0 else 0} for i in range(200)]
    ids = emit_mixed(db, values)
    env = env_for(database_url, tmp_path)
    procs = [subprocess.Popen(WORKER, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)]
    try:
        wait_until(lambda: left(db) == 0, timeout=90, what="every event done", interval=0.2)
        time.sleep(1.5)  # longer than a lock: an event left to lapse would run again now
    finally:
        stop(procs)
    seen = runs(tmp_path)
    assert sorted(seen) == sorted(ids)
    twice = {event_id: len(r) for event_id, r in seen.items() if len(r) > 1}
    assert not twice, f"events that ran more than once without a crash: {twice}"


@pytest.mark.slow
def test_an_event_that_kills_its_worker_is_dead_lettered_and_the_others_run(db, database_url, tmp_path):
    ids = emit_mixed(db, [{"crash": i == 50} for i in range(500)])
    crash = ids[50]
    env = env_for(database_url, tmp_path)
    procs = [subprocess.Popen(WORKER, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)]
    deaths = 0

    def settled() -> bool:
        nonlocal deaths
        for i, proc in enumerate(procs):
            if proc.poll() is not None:
                deaths += 1
                procs[i] = subprocess.Popen(WORKER, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return left(db) == 0

    try:
        wait_until(settled, timeout=120, what="every other event done and the crashing one dead-lettered", interval=0.2)
    finally:
        stop(procs)
    [dead] = dead_letters(db)
    assert dead.id == crash and "3 runs in a row ended with the death of their worker" in dead.error
    assert sorted(runs(tmp_path)) == sorted(i for i in ids if i != crash)
    assert 3 <= deaths <= 4, deaths
