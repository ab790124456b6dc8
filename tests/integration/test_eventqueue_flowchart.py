"""One test per edge of the dequeue flowchart (docs/eventqueue.md), named after the edge."""

import time

import pytest
from running import Running
from sessions_helpers import cut_other_sessions
from waiting import wait_until

from cmb_dagster.eventqueue import (
    Backoff,
    Edge,
    EventQueueOptions,
    EventWorker,
    HandlerRegistry,
    WorkerSettings,
    block,
    dead_letters,
    emit,
    pause,
    replay,
    unpause,
)

SETTINGS = WorkerSettings(listen=False, sweep_interval=0.1)


class Calls:
    def __init__(self):
        self.events = []
        self.fail = 0

    def __call__(self, event):
        self.events.append(event)
        if self.fail:
            self.fail -= 1
            raise RuntimeError(f"boom on {event.id}")


@pytest.fixture
def calls():
    return Calls()


@pytest.fixture
def worker(db, calls):
    registry = HandlerRegistry()
    registry.add("h", calls, lock_expiry=30, max_retries=2, backoff=Backoff(first=0.2, max=0.2))
    registry.add("other", lambda e: None)
    w = EventWorker(db, EventQueueOptions(handlers=registry, worker=SETTINGS))
    w.register()
    yield w
    w.close()


def lock_lapsed(db, event_id) -> bool:
    with db.connection() as conn:
        row = conn.execute("SELECT visible_at <= now() FROM eventqueue_events WHERE id = %s", (event_id,)).fetchone()
    return row[0]


def row(db, event_id):
    with db.connection() as conn:
        return conn.execute(
            "SELECT retries, locked_at, delay_until, visible_at = 'infinity', visible_at = delay_until, last_error "
            "FROM eventqueue_events WHERE id = %s",
            (event_id,),
        ).fetchone()


def test_event_present_pause_none_delay_none_lock_none_claimed_executes_to_completion_delete(db, worker, calls):
    event_id = emit("ns", "h", {"n": 1}, db=db)
    assert worker.dequeue([event_id]) == {event_id: [Edge.LOCK_NONE, Edge.EXECUTES_TO_COMPLETION]}
    assert [e.value for e in calls.events] == [{"n": 1}]
    assert row(db, event_id) is None  # deleted


def test_event_missing_ends(db, worker, calls):
    event_id = emit("ns", "h", 1, db=db)
    worker.dequeue([event_id])
    assert worker.dequeue([event_id]) == {event_id: [Edge.EVENT_MISSING]}
    assert len(calls.events) == 1


def test_paused_ends_and_unpause_requeues(db, worker, calls):
    pause(db, "ns", "h")
    event_id = emit("ns", "h", 1, db=db)
    assert worker.dequeue([event_id]) == {event_id: [Edge.PAUSED]}
    assert worker.run_once() == 0  # parked: the notification is dropped, the sweep does not see it
    assert calls.events == [] and row(db, event_id)[3]  # held
    assert unpause(db, "ns", "h") == 1
    assert worker.run_once() == 1 and [e.id for e in calls.events] == [event_id]


def test_blocked_ends(db, worker, calls):
    block(db, "ns", "h")
    event_id = emit("ns", "h", 1, db=db)
    assert worker.dequeue([event_id]) == {event_id: [Edge.BLOCKED]}
    assert calls.events == []


def test_delay_not_yet_requeues(db, worker, calls):
    event_id = emit("ns", "h", 1, delay=1, db=db)
    assert worker.dequeue([event_id]) == {event_id: [Edge.DELAY_NOT_YET]}
    assert worker.run_once() == 0 and calls.events == []
    rare_sweeps = WorkerSettings(listen=False, sweep_interval=300)
    with Running(EventWorker(db, EventQueueOptions(handlers=worker.registry, worker=rare_sweeps))):
        wait_until(lambda: calls.events, 60, "the event run when its delay is over, long before the next sweep")
    assert [e.id for e in calls.events] == [event_id]


def test_is_locked_requeues(db, worker, calls):
    event_id = emit("ns", "h", 1, db=db)
    with db.connection() as conn:
        conn.execute(
            "UPDATE eventqueue_events SET locked_at = now(), visible_at = now() + interval '30 s' WHERE id = %s",
            (event_id,),
        )
    assert worker.dequeue([event_id]) == {event_id: [Edge.IS_LOCKED]}
    assert worker.run_once() == 0 and calls.events == []


def test_lock_expired_claims(db, worker, calls):
    event_id = emit("ns", "h", 1, db=db)
    with db.connection() as conn:  # a worker claimed it 31 s ago and died
        conn.execute(
            "UPDATE eventqueue_events SET locked_at = now() - interval '31 s', "
            "visible_at = now() - interval '1 s' WHERE id = %s",
            (event_id,),
        )
    assert worker.run_once() == 1
    assert [e.id for e in calls.events] == [event_id] and row(db, event_id) is None


def test_lock_claim_failed_requeues(db, worker, calls):
    event_id = emit("ns", "h", 1, db=db)
    with db.connection() as conn:  # another worker is claiming it right now (holds the row)
        conn.execute("SELECT 1 FROM eventqueue_events WHERE id = %s FOR UPDATE", (event_id,))
        assert worker.dequeue([event_id]) == {event_id: [Edge.LOCK_CLAIM_FAILED]}
        assert worker.run_once() == 0
    assert calls.events == [] and row(db, event_id) is not None
    assert worker.run_once() == 1


def test_exception_retry_allowed_increments_and_delays(db, worker, calls):
    calls.fail = 1
    event_id = emit("ns", "h", 1, db=db)
    assert worker.dequeue([event_id]) == {event_id: [Edge.LOCK_NONE, Edge.RETRY_ALLOWED]}
    retries, locked_at, _, held, visible_at_delay, error = row(db, event_id)
    assert retries == 1 and locked_at is None and visible_at_delay and not held and "boom" in error
    assert worker.run_once() == 0  # not before its backoff
    time.sleep(0.25)
    assert worker.run_once() == 1 and row(db, event_id) is None and len(calls.events) == 2


def test_exception_retry_too_many_dead_letters_and_replay(db, worker, calls):
    calls.fail = 3  # first attempt + max_retries=2
    event_id = emit("ns", "h", {"x": 1}, db=db)
    edges = []
    for _ in range(3):
        time.sleep(0.21)
        edges += worker.dequeue([event_id])[event_id]
    assert edges == [
        Edge.LOCK_NONE,
        Edge.RETRY_ALLOWED,
        Edge.LOCK_NONE,
        Edge.RETRY_ALLOWED,
        Edge.LOCK_NONE,
        Edge.RETRY_TOO_MANY,
    ]
    assert row(db, event_id) is None
    [dead] = dead_letters(db)
    assert (dead.id, dead.value, dead.retries) == (event_id, {"x": 1}, 2)
    assert "boom on" in dead.error and "RuntimeError" in dead.traceback
    assert replay(db, [event_id]) == [event_id]
    assert dead_letters(db) == []
    assert worker.run_once() == 1 and len(calls.events) == 4 and row(db, event_id) is None
    assert worker.run_once() == 0  # the replayed event ran once


class BrokenError(Exception):
    def __str__(self):
        raise ValueError("cannot even describe myself")


def test_an_exception_that_cannot_describe_itself_is_still_retried(db, calls):
    def broken(event):
        calls.events.append(event)
        raise BrokenError()

    registry = HandlerRegistry()
    registry.add("h", broken)
    worker = EventWorker(db, EventQueueOptions(handlers=registry, worker=SETTINGS))
    event_id = emit("ns", "h", 1, db=db) if worker.register() is None else None
    assert worker.dequeue([event_id]) == {event_id: [Edge.LOCK_NONE, Edge.RETRY_ALLOWED]}
    assert row(db, event_id)[5] == "BrokenError: (its message could not be read)"
    worker.close()


def test_exception_in_retry_check_requeues_after_lock_expiry(db, calls):
    def cut_off(event):  # the worker's connection dies while the handler runs: its failure cannot be recorded
        calls.events.append(event)
        if len(calls.events) == 1:
            assert cut_other_sessions(db) >= 1
            raise RuntimeError("boom")

    registry = HandlerRegistry()
    registry.add("h", cut_off, lock_expiry=5.0)
    worker = EventWorker(db, EventQueueOptions(handlers=registry, worker=SETTINGS))
    event_id = emit("ns", "h", 1, db=db) if worker.register() is None else None
    assert worker.dequeue([event_id]) == {event_id: [Edge.LOCK_NONE, Edge.RETRY_CHECK_FAILED]}
    assert row(db, event_id)[1] is not None  # still locked
    assert worker.run_once() == 0
    wait_until(lambda: lock_lapsed(db, event_id), 10, "the event's lock lapsed")
    assert worker.dequeue([event_id]) == {event_id: [Edge.LOCK_EXPIRED, Edge.EXECUTES_TO_COMPLETION]}
    worker.close()
