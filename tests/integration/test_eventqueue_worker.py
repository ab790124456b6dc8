"""The event queue worker: notifications, sweeps, pause/block holds, crons across workers, bad input."""

import itertools
import threading
from collections import Counter
from datetime import timedelta

import pytest
from running import Running
from sessions_helpers import WatchedDatabase
from waiting import wait_until

from cmb_dagster.eventqueue import (
    EventQueueOptions,
    EventWorker,
    HandlerRegistry,
    InvalidEventQueueInput,
    NotDead,
    UnknownHandler,
    WorkerSettings,
    block,
    emit,
    emit_many,
    pause,
    register,
    replay,
    rules,
    sql,
    status,
    unblock,
    unpause,
)


class Recorder:
    def __init__(self):
        self.lock = threading.Lock()
        self.seen = Counter()

    def __call__(self, event):
        with self.lock:
            self.seen[event.id] += 1


def registry_with(recorder, *names, **config):
    registry = HandlerRegistry()
    for name in names:
        registry.add(name, recorder, **config)
    return registry


def worker_for(db, registry, settings=None):
    """A worker of ``registry`` whose handlers are registered, so events can be emitted to them."""
    worker = EventWorker(db, EventQueueOptions(handlers=registry, worker=settings or WorkerSettings()))
    worker.register()
    return worker


LISTENING = (  # the sessions of a listener (LISTEN, then its heartbeats) in the test's database
    "datname = current_database() AND pid <> pg_backend_pid() AND (query LIKE 'LISTEN%%' OR query = 'SELECT 1')"
)


def listening_sessions(db) -> list[int]:
    with db.connection() as conn:
        return [row[0] for row in conn.execute(f"SELECT pid FROM pg_stat_activity WHERE {LISTENING}")]


def end_listening_sessions(db) -> list[int]:
    with db.connection() as conn:
        rows = conn.execute(f"SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity WHERE {LISTENING}")
        return [pid for pid, ended in rows if ended]


def parked(db) -> int:
    """Events a claim set aside under a rule, until the rule is lifted."""
    with db.connection() as conn:
        return conn.execute("SELECT count(*) FROM eventqueue_events WHERE visible_at = 'infinity'").fetchone()[0]


def queued(db):
    with db.connection() as conn:
        return conn.execute("SELECT count(*) FROM eventqueue_events").fetchone()[0]


def test_emit_in_callers_transaction_exists_only_if_it_commits(db):
    register(db, registry_with(Recorder(), "h"))
    with db.connection() as conn:
        emit("ns", "h", 1, conn=conn)
        conn.rollback()
    assert queued(db) == 0
    with db.connection() as conn:
        ids = emit_many([{"namespace": "ns", "handler": "h", "value": i} for i in range(3)], conn=conn)
    assert len(ids) == 3 and queued(db) == 3


def test_bad_input_is_refused_naming_the_field_and_writes_nothing(db):
    register(db, registry_with(Recorder(), "h"))
    with pytest.raises(UnknownHandler, match="handler: no handler named 'nope'"):
        emit("ns", "nope", 1, db=db)
    with pytest.raises(UnknownHandler, match="handler"):
        emit_many(
            [{"namespace": "ns", "handler": "h", "value": 1}, {"namespace": "ns", "handler": "nope", "value": 2}], db=db
        )
    with pytest.raises(InvalidEventQueueInput, match="value: not JSON"):
        emit("ns", "h", {"when": object()}, db=db)
    with pytest.raises(InvalidEventQueueInput, match="value"):
        emit("ns", "h", float("nan"), db=db)
    with pytest.raises(InvalidEventQueueInput, match="delay: must not be negative"):
        emit("ns", "h", 1, delay=-1, db=db)
    with pytest.raises(InvalidEventQueueInput, match="delay: must not be negative"):
        emit("ns", "h", 1, delay=timedelta(seconds=-1), db=db)
    with pytest.raises(InvalidEventQueueInput, match=r"events\[1\].namespace"):
        emit_many(
            [{"namespace": "ns", "handler": "h", "value": 1}, {"namespace": "", "handler": "h", "value": 1}], db=db
        )
    with pytest.raises(UnknownHandler, match="handler"):
        pause(db, "ns", "nope")
    with pytest.raises(NotDead, match="ids: event 12345 is not in the dead-letter table"):
        replay(db, [12345])
    assert queued(db) == 0 and rules(db) == []
    with db.connection() as conn:  # the caller's transaction stays usable after a refused emit
        with pytest.raises(UnknownHandler):
            emit("ns", "nope", 1, conn=conn)
        emit("ns", "h", 1, conn=conn)
    assert queued(db) == 1


def test_notification_wakes_worker_at_once(db):
    recorder = Recorder()
    worker = worker_for(db, registry_with(recorder, "h"), WorkerSettings(sweep_interval=300))
    with Running(worker):
        wait_until(lambda: worker.listening, what="listener connected")
        first = emit("ns", "h", 1, db=db)
        # run and deleted: the worker deletes what it finished as it goes idle, then sleeps until the next sweep
        wait_until(lambda: recorder.seen[first] and queued(db) == 0, timeout=60, what="a first event run")
        event_id = emit("ns", "h", 1, db=db)
        wait_until(lambda: recorder.seen[event_id], timeout=60, what="the event run, long before the next sweep")
    assert queued(db) == 0


def test_a_busy_worker_deletes_the_events_a_batch_finished_with_its_next_claim(db, database_url):
    """One statement per batch: each claim deletes what the batch before it finished; nothing is left once idle."""
    recorder = Recorder()
    settings = WorkerSettings(listen=False, batch_size=50, sweep_interval=0.2)
    recorded = WatchedDatabase(database_url)
    worker = worker_for(recorded, registry_with(recorder, "h"), settings)
    emit_many([{"namespace": "ns", "handler": "h", "value": i} for i in range(500)], db=db)
    with Running(worker):
        wait_until(lambda: len(recorder.seen) == 500 and queued(db) == 0, timeout=30, what="the backlog run, deleted")
    recorded.close()
    assert set(recorder.seen.values()) == {1}
    assert recorded.statements.count(sql.CLAIM_DUE[False]) >= 10
    assert recorded.statements.count(sql.DELETE_DONE) <= 1


def test_notifications_off_events_still_run_within_sweep_and_listener_reconnects(db):
    recorder = Recorder()
    settings = WorkerSettings(sweep_interval=0.5, heartbeat=0.2)
    worker = worker_for(db, registry_with(recorder, "h"), settings)
    with Running(worker):
        wait_until(lambda: worker.listening, what="listener connected")
        killed = end_listening_sessions(db)  # the LISTEN connection killed behind the worker's back
        assert killed
        ids = [emit("ns", "h", i, db=db) for i in range(20)]
        wait_until(lambda: all(recorder.seen[i] for i in ids), timeout=10, what="events run without notifications")
        wait_until(
            lambda: worker.listening and set(listening_sessions(db)) - set(killed), timeout=10, what="listener back"
        )
        event_id = emit("ns", "h", 1, db=db)
        wait_until(lambda: recorder.seen[event_id], timeout=10, what="event run after reconnect")


def test_sweep_only_worker_runs_events_within_sweep_interval(db):
    recorder = Recorder()
    worker = worker_for(db, registry_with(recorder, "h"), WorkerSettings(listen=False, sweep_interval=0.3))
    with Running(worker):  # no notification: only a sweep finds the event
        event_id = emit("ns", "h", 1, db=db)
        wait_until(lambda: recorder.seen[event_id], timeout=10, what="event run by a sweep")


def test_pause_holds_unpause_delivers_and_other_handlers_go_on(db):
    recorder = Recorder()
    worker = worker_for(db, registry_with(recorder, "paused", "free"), WorkerSettings(sweep_interval=0.2))
    pause(db, "ns", "paused")
    with Running(worker):
        held = emit_many([{"namespace": "ns", "handler": "paused", "value": i} for i in range(50)], db=db)
        other_ns = emit("other", "paused", 1, db=db)  # another namespace is not paused
        free = emit_many([{"namespace": "ns", "handler": "free", "value": i} for i in range(50)], db=db)
        wait_until(lambda: all(recorder.seen[i] for i in [*free, other_ns]), timeout=10, what="free events run")
        wait_until(lambda: status_of(db, "paused").held == 50, timeout=10, what="paused events held")
        assert not any(recorder.seen[i] for i in held)  # none processed while paused
        assert [r.held for r in rules(db)] == [50]
        assert unpause(db, "ns", "paused") == 50
        wait_until(lambda: all(recorder.seen[i] for i in held), timeout=10, what="held events delivered")
    assert queued(db) == 0 and max(recorder.seen.values()) == 1


def test_block_holds_until_unblock_and_pause_plus_block_needs_both_lifted(db):
    recorder = Recorder()
    worker = worker_for(db, registry_with(recorder, "h"), WorkerSettings(sweep_interval=0.2))
    block(db, "ns", "h")
    pause(db, "ns", "h")
    with Running(worker):
        ids = emit_many([{"namespace": "ns", "handler": "h", "value": i} for i in range(10)], db=db)
        wait_until(lambda: status_of(db, "h").held == 10, timeout=10, what="blocked events held")
        assert status_of(db, "h").rules == ["block ns/worker", "pause ns/worker"]
        assert unpause(db, "ns", "h") == 0  # still blocked
        wait_until(lambda: parked(db) == 10, timeout=10, what="the blocked events parked by the worker's claims")
        assert not any(recorder.seen[i] for i in ids)
        assert unblock(db, "ns", "h") == 10
        wait_until(lambda: all(recorder.seen[i] for i in ids), timeout=10, what="unblocked events delivered")


def status_of(db, handler):
    return next(s for s in status(db).handlers if s.handler == handler)


def test_events_under_a_rule_count_as_held_with_no_worker_running(db):
    worker_for(db, registry_with(Recorder(), "h"), WorkerSettings(listen=False)).close()  # registered, not running
    pause(db, "ns", "h")
    emit_many([{"namespace": "ns", "handler": "h", "value": i} for i in range(3)], db=db)
    emit("ns", "h", 1, delay=60, db=db)
    emit("other", "h", 1, db=db)  # another namespace is not paused
    s = status_of(db, "h")
    assert (s.queued, s.delayed, s.held) == (1, 0, 4)
    assert [r.held for r in rules(db)] == [4]


def test_status_counts(db):
    recorder = Recorder()
    registry = registry_with(recorder, "h", max_retries=0)
    worker = worker_for(db, registry, WorkerSettings(listen=False))
    emit("ns", "h", 1, db=db)
    emit("ns", "h", 1, delay=60, db=db)
    s = status_of(db, "h")
    assert (s.queued, s.delayed, s.locked, s.held, s.dead, s.kind) == (1, 1, 0, 0, 0, "python")
    assert s.oldest_queued_seconds >= 0
    assert status(db).totals == {"queued": 1, "delayed": 1, "locked": 0, "held": 0, "dead": 0}
    with pytest.warns(DeprecationWarning):  # status(db) was the list of rows
        assert [r.handler for r in status(db)] == ["h"]
    worker.close()


def test_the_old_constructor_still_runs_events_with_a_warning(db):
    recorder = Recorder()
    with pytest.warns(DeprecationWarning, match="EventQueueOptions"):
        worker = EventWorker(db, registry_with(recorder, "h"), WorkerSettings(listen=False, sweep_interval=0.1))
    assert worker.settings.sweep_interval == 0.1 and worker.names == ["h"]
    worker.register()
    event_id = emit("ns", "h", 1, db=db)
    report = worker.run(60, on_progress=lambda report: recorder.seen[event_id] and worker.stop())
    assert report.items == 1 and recorder.seen[event_id] == 1
    with pytest.warns(DeprecationWarning):
        EventWorker(db, registry_with(recorder, "h"))  # as the README shows it
    with pytest.raises(InvalidEventQueueInput, match="settings"):
        EventWorker(db, EventQueueOptions(handlers=registry_with(recorder, "h")), WorkerSettings())


def test_cron_handler_emits_once_per_interval_across_workers(db):
    recorder = Recorder()

    def make_worker():
        registry = registry_with(recorder, "tick")
        registry.cron("every_second", "* * * * * *", handler="tick", value={"cron": True})
        return worker_for(db, registry, WorkerSettings(sweep_interval=0.1, cron_interval=0.05))

    def fire_times() -> list:
        with db.connection() as conn:
            return [f[0] for f in conn.execute("SELECT fire_time FROM eventqueue_cron_records ORDER BY fire_time")]

    workers = [make_worker() for _ in range(3)]
    with Running(*workers):
        wait_until(lambda: len(fire_times()) >= 3, timeout=30, what="three fires")
    times = fire_times()
    assert len(set(times)) == len(times)
    # one fire per second at most (a fire can only be skipped if every worker stalled for a whole second)
    assert all((b - a).total_seconds() >= 1 for a, b in itertools.pairwise(times))
    wait_until(lambda: sum(recorder.seen.values()) == len(times), timeout=5, what="cron events run")
    assert max(recorder.seen.values()) == 1
