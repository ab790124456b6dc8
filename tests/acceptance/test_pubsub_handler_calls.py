"""Consumer processes and what their handler does: a call past its time limit keeps its partition until it has
ended (the next batch never runs beside it, here or in a standby), and a handler that calls ``sys.exit()`` fails
its events, not its consumer."""

from __future__ import annotations

import json
import os
from pathlib import Path

from intervals import most_at_once
from multihost import HANDLERS_DIR, WorkerProcess
from waiting import wait_until

from cmb_dagster.pubsub import dead_letters, publish

TIMEOUT = 3.0
SLOW = 4.5  # past TIMEOUT by more than the backoff before a retry, within twice TIMEOUT (then the worker is stuck)


def consumer_env(database_url: str, tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "CMB_DATABASE_URL": database_url,
        "CMB_TEST_CALLS": str(tmp_path / "calls.jsonl"),
        "PYTHONPATH": os.pathsep.join([str(HANDLERS_DIR), os.environ.get("PYTHONPATH", "")]),
    }


def publish_all(db, payloads: list[dict]) -> list[int]:
    with db.connection() as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS public.results (event_id bigint PRIMARY KEY)")
        return [publish(0, p, conn=conn) for p in payloads]


def results(db) -> list[int]:
    with db.connection() as conn:
        return [r[0] for r in conn.execute("SELECT event_id FROM public.results ORDER BY event_id")]


def test_a_handler_past_its_time_limit_is_never_overlapped_by_the_next_batch_of_its_partition(
    db, database_url, tmp_path: Path
):
    ids = publish_all(db, [{"n": n, "slow": SLOW if n == 7 else None} for n in range(20)])
    consume = ["pubsub", "consume", "calls", "--handler", "pubsub_handlers:record_calls", "--batch-size", "5",
               "--handler-timeout", str(TIMEOUT), "--lease-ttl", "2"]  # fmt: skip
    env = consumer_env(database_url, tmp_path)
    workers = [WorkerProcess(consume, env, tmp_path / f"worker-{i}.log") for i in range(2)]  # one holds, one stands by
    try:
        wait_until(lambda: results(db) == ids, 90, "every event delivered")
    finally:
        for worker in workers:
            worker.close()
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert most_at_once((start, end) for _, start, end, _ in calls) == 1, calls
    [slow] = [events for _, start, end, events in calls if end - start > TIMEOUT]  # the one that ran past its limit
    assert ids[7] in slow


def test_a_handler_calling_sys_exit_fails_its_events_and_the_consumer_goes_on(db, database_url, tmp_path: Path):
    ids = publish_all(db, [{"n": n, "exit": n == 3} for n in range(10)])
    consume = ["pubsub", "consume", "exits", "--handler", "pubsub_handlers:exits", "--batch-size", "5",
               "--max-attempts", "2"]  # fmt: skip
    worker = WorkerProcess(consume, consumer_env(database_url, tmp_path), tmp_path / "worker.log")
    try:

        def parked() -> list:
            with db.connection() as conn:
                return dead_letters(conn, "exits", 0)

        wait_until(lambda: results(db) == [i for i in ids if i != ids[3]] and parked(), 60, "the others delivered")
        [dead] = parked()
        assert dead.event.id == ids[3] and dead.error == "UserCodeExit: user code raised SystemExit: 3"
        later = publish_all(db, [{"n": 10}])
        wait_until(lambda: later[0] in results(db), 30, "an event published afterwards delivered")
        assert worker.proc.poll() is None, worker.log
    finally:
        worker.close()
