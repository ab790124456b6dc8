"""A Postgres restart while workers run (a dedicated embedded server, stopped for two seconds): stage and event
queue workers reconnect by themselves, lose nothing and apply nothing twice. While it is stopped or frozen, the
metrics endpoint answers in time, every engine counted in ``cmb_scrape_errors``, and reads them again once it is
back."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
from running import Running
from scrapes import failed_engines, parse, scrape, scrapes_at_once
from test_callbacks_crash import pg_ctl
from waiting import wait_until

from cmb_dagster.database import Database
from cmb_dagster.embedded import data_dir, embedded_url, stop_embedded
from cmb_dagster.eventqueue import EventQueueOptions, EventWorker, HandlerRegistry, WorkerSettings, emit_many
from cmb_dagster.metrics import CACHE_S, ENGINES, MetricsServer, serve
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


def test_workers_started_while_postgres_is_stopped_start_once_it_answers(server_home):
    """A worker process started during a restart or a failover waits for the database instead of dying (each
    engine reads the database while it builds its loops: a consumer registers, stages set up, callbacks record
    their limits)."""
    from cmb_dagster.callbacks import CallbackSettings, CallbackWorker
    from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker, publish

    home = server_home / "pg"
    Database(embedded_url(home)).upgrade()
    pg_ctl(home, "stop")
    db = Database(embedded_url(home))  # as in a process starting now: it has not reached the database yet
    delivered: list[int] = []
    consumer = ConsumerWorker(
        db, ConsumerSpec(consumer_id="late", handler=lambda conn, events: delivered.extend(e.id for e in events))
    )
    stages = StageWorker(db, StageOptions(stages=[Count()], shard_count=2, idle_sleep=0.2))
    callbacks = CallbackWorker(db, CallbackSettings(poll_interval=0.2))
    try:
        with Running(consumer, stages, callbacks) as running:
            wait_until(lambda: all(t.is_alive() for t in running.threads), 5, "the workers running")
            time.sleep(1.5)  # each tried to start and was told the database is away
            assert all(thread.is_alive() for thread in running.threads)
            pg_ctl(home, "restart")  # (restart: it starts a stopped server with the options it had)
            with db.connection() as conn:
                event = publish(0, {"n": 1}, conn=conn)
            StageStore(db, [Count()]).put("e1", {})
            wait_until(lambda: delivered == [event], 60, "the consumer delivered an event")
            with db.connection() as conn:
                wait_until(
                    lambda: conn.execute("SELECT count(*) FROM stage_entities WHERE payload ? 'n'").fetchone()[0],
                    60,
                    "the stage ran",
                )
    finally:
        db.close()
        stop_embedded(home)


@contextmanager
def metrics_of_own_server(home: Path) -> Iterator[MetricsServer]:
    """The metrics endpoint of a server of the test's own under ``home``, once it has read every engine."""
    db = Database(embedded_url(home))
    db.ensure_ready()  # migrated (the metrics never migrate)
    server = serve(db, port=0)
    try:
        assert failed_engines(parse(scrape(server.url))) == set()
        yield server
    finally:
        server.stop()
        db.close()
        stop_embedded(home)


def assert_every_engine_failed_in_time(server: MetricsServer) -> None:
    time.sleep(CACHE_S)  # the reading before the outage no longer answers
    for samples in scrapes_at_once(server.url, 20):
        assert failed_engines(samples) == set(ENGINES)


def assert_every_engine_read_again(server: MetricsServer) -> None:
    wait_until(lambda: not failed_engines(parse(scrape(server.url))), 60, "every engine read again", interval=0.5)


def test_the_metrics_answer_in_time_while_postgres_is_stopped(server_home, caplog):
    home = server_home / "pg"
    with metrics_of_own_server(home) as server:
        pg_ctl(home, "stop")
        assert_every_engine_failed_in_time(server)
        assert "the database did not answer" in caplog.text  # the engines after the first were not asked
        pg_ctl(home, "restart")
        assert_every_engine_read_again(server)


def test_the_metrics_answer_in_time_while_postgres_is_frozen(server_home):
    home = server_home / "pg"
    with metrics_of_own_server(home) as server:
        postmaster = psutil.Process(int((data_dir(home) / "postmaster.pid").read_text().split()[0]))
        frozen = [postmaster, *postmaster.children()]  # connections stay open; nothing answers on them
        for process in frozen:
            process.send_signal(signal.SIGSTOP)
        try:
            assert_every_engine_failed_in_time(server)
        finally:
            for process in frozen:
                process.send_signal(signal.SIGCONT)
        assert_every_engine_read_again(server)
