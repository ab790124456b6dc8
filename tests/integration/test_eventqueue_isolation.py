"""Isolation in the event queue against real Postgres: rules that stop claimed events, bad input refused
before it reaches Postgres, errors that cannot be stored as they are, and deletes retried after a reconnect."""

from __future__ import annotations

import time

import pytest
from running import Running
from sessions_helpers import cut_other_sessions
from waiting import wait_until

from cmb_dagster.eventqueue import (
    Backoff,
    EventQueueOptions,
    EventWorker,
    HandlerRegistry,
    InvalidEventQueueInput,
    WorkerSettings,
    dead_letters,
    emit,
    emit_many,
    pause,
    status,
    unpause,
)


def test_no_claimed_event_of_a_paused_handler_starts_after_pause_returns(db):
    starts: list[tuple[int, float]] = []
    others: list[int] = []
    registry = HandlerRegistry()
    registry.add("slow", lambda e: (starts.append((e.id, time.monotonic())), time.sleep(0.5)))
    registry.add("other", lambda e: others.append(e.id))
    worker = worker_for(db, registry, WorkerSettings(batch_size=10, sweep_interval=0.1, worker_concurrency=1))
    ids = [emit("ns", "slow", i, db=db) for i in range(10)]
    with Running(worker):
        wait_until(lambda: worker.listening and starts, 10, "the first event started")
        pause(db, "ns", "slow")
        paused_at = time.monotonic()
        other = emit_many([{"namespace": "ns", "handler": "other", "value": i} for i in range(1000)], db=db)
        # one slot and half a second per call: the held events, had they been claimable, would have started before
        # the other handler's events, which take turns with them, were all done
        wait_until(lambda: sorted(others) == other, 30, "1,000 events of a handler that is not paused done")
        started = [event_id for event_id, at in starts if at > paused_at]
        assert not started, f"events started after pause() returned: {started}"
        [slow] = [s for s in status(db).handlers if s.handler == "slow"]
        assert slow.held == 10 - len(starts) >= 5  # pause() did not wait for the events running: the rest is held
        unpause(db, "ns", "slow")
        wait_until(lambda: sorted(e for e, _ in starts) == ids, 20, "every event ran after unpause")


def test_pause_waits_for_a_worker_that_has_not_applied_it(db, caplog):
    """A worker that misses the rule's notification applies and acknowledges it at its next claim: pause() returns
    on that acknowledgement, not at the end of its wait."""
    registry = HandlerRegistry()
    registry.add("h", lambda e: None)
    with Running(worker_for(db, registry, WorkerSettings(listen=False, sweep_interval=0.3))):
        wait_until(lambda: _live_workers(db) == 1, 10, "the worker's lease")
        pause(db, "ns", "h", wait=60)
        assert not [r for r in caplog.records if "did not confirm" in r.getMessage()], "pause() waited it out"
        with db.connection() as conn:
            assert conn.execute("SELECT rules_seen FROM eventqueue_workers").fetchone()[0] >= 1


def worker_for(db, registry: HandlerRegistry, settings: WorkerSettings) -> EventWorker:
    """A worker of ``registry`` whose handlers are registered, so events can be emitted to them."""
    worker = EventWorker(db, EventQueueOptions(handlers=registry, worker=settings))
    worker.register()
    return worker


def _locked(db) -> int:
    """How many events a lock holds."""
    with db.connection() as conn:
        return conn.execute("SELECT count(*) FROM eventqueue_events WHERE visible_at > now()").fetchone()[0]


def _live_workers(db) -> int:
    with db.connection() as conn:
        return conn.execute(
            "SELECT count(*) FROM leases WHERE kind = 'eventqueue.worker' AND expires_at > now()"
        ).fetchone()[0]


@pytest.mark.parametrize(
    ("field", "event"),
    [
        ("value", {"value": {"k": "\udc80"}}),
        ("namespace", {"namespace": "ns\ud800"}),
        ("delay", {"delay": 1e13}),
        ("delay", {"delay": 1.7e12}),  # milliseconds passed as seconds
        ("delay", {"delay": 1e300}),
    ],
)
def test_bad_input_is_refused_before_postgres_and_the_callers_transaction_goes_on(db, field, event):
    registry = HandlerRegistry()
    registry.add("h", lambda e: None)
    worker_for(db, registry, WorkerSettings())
    with db.connection() as conn:
        with pytest.raises(InvalidEventQueueInput, match=f"^{field}: "):
            emit(**{"namespace": "ns", "handler": "h", "value": 1, **event}, conn=conn)
        assert conn.execute("SELECT 1").fetchone() == (1,)  # the transaction is not aborted
        assert conn.execute("SELECT count(*) FROM eventqueue_events").fetchone() == (0,)


def test_an_event_visible_beyond_what_python_can_hold_does_not_break_the_idle_worker(db):
    registry = HandlerRegistry()
    registry.add("h", lambda e: None)
    worker = worker_for(db, registry, WorkerSettings(listen=False))
    emit("ns", "h", 1, delay=3600, db=db)  # a delayed event: the idle worker reads when it comes due
    with db.connection() as conn:  # written around the API
        conn.execute("UPDATE eventqueue_events SET delay_until = '55000-01-01', visible_at = '55000-01-01'")
    assert worker.run_once() == 0
    rounds = []

    def two_rounds(report) -> None:  # the loop turned twice: it slept in between
        rounds.append(report)
        if len(rounds) == 2:
            worker.stop()

    report = worker.run(60, on_progress=two_rounds)
    assert report.errors == 0 and report.steps == 2


def test_an_error_message_postgres_cannot_store_as_it_is_still_dead_letters_the_event(db):
    def poison(event):
        raise ValueError("bad \x00 byte and \udc80 half a character")

    registry = HandlerRegistry()
    registry.add("h", poison, max_retries=1, backoff=Backoff(first=0.05))
    worker = worker_for(db, registry, WorkerSettings(listen=False))
    event_id = emit("ns", "h", 1, db=db)
    wait_until(lambda: worker.run_once() == 0 and dead_letters(db), 10, "the event dead-lettered")
    [dead] = dead_letters(db)
    assert dead.id == event_id and dead.retries == 1
    assert dead.error == "ValueError: bad \\0 byte and \ufffd half a character"
    assert "\x00" not in dead.traceback and "ValueError" in dead.traceback
    worker.close()


def test_finished_events_are_deleted_after_the_connection_comes_back(db):
    """The worker's connection is cut after its handlers ran: the delete is sent again once it reconnects,
    so no finished event runs a second time when its lock expires."""
    ran: list[int] = []
    registry = HandlerRegistry()

    def record(event):
        ran.append(event.id)
        if len(ran) == 5:
            assert cut_other_sessions(db) >= 1

    registry.add("h", record, lock_expiry=1.0)
    worker = worker_for(db, registry, WorkerSettings(listen=False, sweep_interval=0.1))
    ids = [emit("ns", "h", i, db=db) for i in range(5)]
    assert worker.run_once() == 5  # the batch ran; its delete could not be sent
    other = EventWorker(db, EventQueueOptions(handlers=registry, worker=WorkerSettings(listen=False)))
    wait_until(lambda: _locked(db) == 0, 10, "the events' locks lapsed")
    worker.run_once()  # reconnects and deletes them first
    assert other.run_once() == 0
    assert sorted(ran) == ids
    worker.close()
    other.close()
