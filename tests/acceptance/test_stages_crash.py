"""Stage workers killed with kill -9 at random points: every entity reaches the state of a run without
kills, no queue entry is lost, state and entity never diverge, timers never fire early."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from waiting import wait_until

from cmb_dagster.database import Database
from cmb_dagster.stages import StageStore

HERE = Path(__file__).parent
CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]
WORKER = [*CLI, "stages", "worker", "--stages", "stages_crash_stages:options"]
COUNT = 600


def finished(db: Database) -> int:
    with db.connection() as conn:
        return conn.execute("SELECT count(*) FROM stage_entities WHERE payload ? 'expired_late_ms'").fetchone()[0]


@pytest.mark.slow
def test_kill_9_at_random_points_converges_to_the_same_state(db, database_url):
    rng = random.Random(9)
    env = {
        **os.environ,
        "CMB_DATABASE_URL": database_url,
        "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    sys.path.insert(0, str(HERE))
    import stages_crash_stages

    store = StageStore(db, stages_crash_stages.options.stages)
    store.put_many({f"k{i}": {"a": i} for i in range(COUNT)})

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(WORKER, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    workers = [start(), start()]
    kills = 0
    try:
        while kills < 6 and finished(db) < COUNT:
            time.sleep(rng.uniform(0.3, 1.2))
            victim = rng.randrange(len(workers))
            workers[victim].send_signal(signal.SIGKILL)
            workers[victim].wait(10)
            kills += 1
            workers[victim] = start()
        assert kills >= 3, "the run ended before the kills"
        wait_until(lambda: finished(db) == COUNT, timeout=90, what="every entity through every stage")
    finally:
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
        for w in workers:
            try:
                w.wait(20)
            except subprocess.TimeoutExpired:
                w.kill()
    with db.connection() as conn:
        payloads = dict(conn.execute("SELECT entity_id, payload FROM stage_entities").fetchall())
        versions = dict(conn.execute("SELECT entity_id, version FROM stage_entities").fetchall())
        states = conn.execute("SELECT entity_id, stage, state FROM stage_states WHERE state IS NOT NULL").fetchall()
        left = conn.execute("SELECT count(*) FROM stage_queue").fetchone()[0]
    for i in range(COUNT):
        p = payloads[f"k{i}"]
        assert (p["a"], p["b"], p["c"], p["d"]) == (i, i + 1, i + 2, i + 3)
        assert "early" not in p and p["expired_late_ms"] >= 0  # never early
        assert versions[f"k{i}"] == 6  # put, three stages, the timer set, the timer fired: nothing twice
    assert len(states) == 4 * COUNT
    # state and entity never diverge: every state was saved with exactly the change it made, once
    assert all(state["runs"] == 1 for _, _, state in states)
    assert left == 0
