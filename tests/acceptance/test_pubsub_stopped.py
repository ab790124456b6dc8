"""A consumer process stopped (SIGSTOP) while its batch waits for its watermark: once the batch has its lock, the
server ends its transaction (it is idle: the lease check and the lock went with a Sync), a standby takes the consumer
over, and the resumed process delivers nothing of what it lost; every event is applied once."""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

import psycopg
from multihost import HANDLERS_DIR, WorkerProcess, held_by, read_calls, take_over
from waiting import wait_until

from cmb_dagster.pubsub import publish

TTL = 3
KIND = "pubsub.consumer"
CONSUME = ["pubsub", "consume", "results", "--handler", "multihost_handlers:pubsub_record", "--batch-size", "10",
           "--lease-ttl", str(TTL), "--handler-timeout", "1"]  # fmt: skip


def batch_waiting_for_its_watermark(db) -> bool:
    with db.connection() as conn:
        return conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND query LIKE '%%pubsub_watermarks%%FOR NO KEY UPDATE%%')"
        ).fetchone()[0]


def test_a_consumer_stopped_while_its_batch_waits_is_taken_over_and_delivers_nothing_more(
    db, database_url, tmp_path: Path
):
    env = {
        **os.environ,
        "CMB_DATABASE_URL": database_url,
        "CMB_TEST_CALLS": str(tmp_path / "calls.jsonl"),
        "PYTHONPATH": os.pathsep.join([str(HANDLERS_DIR), os.environ.get("PYTHONPATH", "")]),
    }
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.results (item int NOT NULL, pid int NOT NULL)")

    def publish_range(numbers: range) -> None:
        with db.connection() as conn:
            for n in numbers:
                publish(0, {"n": n}, topic="work", conn=conn)

    def results() -> Counter:
        with db.connection() as conn:
            return Counter(dict(conn.execute("SELECT item, count(*) FROM public.results GROUP BY item").fetchall()))

    publish_range(range(50))
    victim = WorkerProcess(CONSUME, env, tmp_path / "victim.log")
    other = None
    try:
        wait_until(lambda: len(results()) == 50, 60, "the victim delivered the first events")
        other = WorkerProcess(CONSUME, env, tmp_path / "other.log")
        with psycopg.connect(database_url) as gate:
            gate.execute("SELECT 1 FROM cmb.pubsub_watermarks WHERE consumer_id = 'results' FOR UPDATE")
            publish_range(range(50, 150))
            wait_until(lambda: batch_waiting_for_its_watermark(db), 30, "the victim's batch waits at the gate")
            victim.signal(signal.SIGSTOP)
            lost = held_by(db, KIND, victim)
            assert list(lost) == ["results@0"]
            gate.rollback()  # the stopped batch gets the lock: its transaction is idle from then on
        wait_until(lambda: take_over(db, KIND, lost, other), 30, "the standby took the consumer over")
        wait_until(lambda: len(results()) == 150, 60, "the standby delivered every event")
        resumed_at = victim.signal(signal.SIGCONT)
        publish_range(range(150, 170))
        wait_until(lambda: len(results()) == 170, 30, "the events published after the resume delivered")
        late = [c for c in read_calls(tmp_path / "calls.jsonl") if c[0] == victim.pid and c[1] >= resumed_at]
        assert late == [], "the resumed victim called its handler for the consumer it had lost"
        assert max(results().values()) == 1
    finally:
        for worker in (victim, other):
            if worker is not None:
                worker.close()
