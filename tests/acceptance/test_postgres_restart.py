"""A Postgres restart while workers run (a dedicated embedded server, stopped for two seconds): stage and event
queue workers reconnect by themselves, lose nothing and apply nothing twice."""

from __future__ import annotations

import threading
import time
from collections import Counter

from test_callbacks_crash import pg_ctl
from waiting import wait_until

from cmb_dagster.database import Database
from cmb_dagster.embedded import embedded_url, stop_embedded
from cmb_dagster.eventqueue import EventQueueOptions, EventWorker, HandlerRegistry, WorkerSettings, emit_many
from cmb_dagster.stages import Entity, MergePatch, Stage, StageOptions, StageResult, StageStore, StageWorker


class Count(Stage):
    name = "count"

    def process(self, entity: Entity, state) -> StageResult:
        time.sleep(0.002)
        return StageResult(update=MergePatch({"n": entity.payload.get("n", 0) + 1}))


def _restart_while(home, running: threading.Thread, progressed) -> None:
    running.start()
    wait_until(progressed, 30, "work before the restart")
    pg_ctl(home, "stop")
    time.sleep(2)  # deliberate downtime
    pg_ctl(home, "restart")


def test_stage_workers_ride_out_a_postgres_restart(server_home):
    home = server_home / "pg"
    db = Database(embedded_url(home))
    options = StageOptions(stages=[Count()], shard_count=4, batch_size=50, lease_ttl=2.0, idle_sleep=0.2)
    store = StageStore(db, options.stages)
    store.put_many({f"e{i}": {} for i in range(2000)})
    worker = StageWorker(db, options)
    thread = threading.Thread(target=worker.run, daemon=True)

    def done() -> int:
        with db.connection() as conn:
            return conn.execute("SELECT count(*) FROM stage_entities WHERE payload ? 'n'").fetchone()[0]

    try:
        _restart_while(home, thread, lambda: done() >= 100)
        wait_until(lambda: done() == 2000, 90, "every entity processed after the restart", interval=0.2)
        with db.connection() as conn:
            counts = dict(conn.execute("SELECT payload->>'n', count(*) FROM stage_entities GROUP BY 1").fetchall())
            left = conn.execute("SELECT count(*) FROM stage_queue").fetchone()[0]
        assert counts == {"1": 2000} and left == 0  # each entity's result saved once
    finally:
        worker.stop()
        thread.join(30)
        db.close()
        stop_embedded(home)


def test_event_queue_workers_ride_out_a_postgres_restart(server_home):
    home = server_home / "pg"
    db = Database(embedded_url(home))
    runs: Counter[int] = Counter()
    registry = HandlerRegistry()
    registry.add("h", lambda event: (runs.update([event.id]), time.sleep(0.001)), lock_expiry=5)
    worker = EventWorker(
        db, EventQueueOptions(handlers=registry, worker=WorkerSettings(sweep_interval=0.2, lease_ttl=2))
    )
    worker.register()
    ids = emit_many([{"namespace": "ns", "handler": "h", "value": i} for i in range(3000)], db=db)
    thread = threading.Thread(target=worker.run, daemon=True)

    def left() -> int:
        with db.connection() as conn:
            return conn.execute("SELECT count(*) FROM eventqueue_events").fetchone()[0]

    try:
        _restart_while(home, thread, lambda: len(runs) >= 200)
        wait_until(lambda: left() == 0, 90, "every event done after the restart", interval=0.2)
        assert sorted(runs) == ids
        # at least once: only events in flight when the server went away may have run twice
        assert sum(1 for n in runs.values() if n > 1) <= WorkerSettings().batch_size
    finally:
        worker.stop()
        thread.join(30)
        db.close()
        stop_embedded(home)
