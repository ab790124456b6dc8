"""A worker whose claim lapsed while its handler ran (a stopped process, a host cut off past the lock's expiry)
leaves the event to the worker that claimed it since: finishing does not delete it under that worker."""

import threading

from running import Running
from waiting import wait_until

from cmb_dagster.eventqueue import EventQueueOptions, EventWorker, HandlerRegistry, WorkerSettings, emit

FAST = WorkerSettings(sweep_interval=0.2)


def worker_running(db, handler) -> EventWorker:
    registry = HandlerRegistry()
    registry.add("h", handler, lock_expiry=60)
    worker = EventWorker(db, EventQueueOptions(handlers=registry, worker=FAST))
    worker.register()
    return worker


def test_a_handler_finishing_after_its_claim_lapsed_leaves_the_new_claim_alone(db):
    first_started, first_go = threading.Event(), threading.Event()
    second_started, second_go = threading.Event(), threading.Event()

    def first(event):
        first_started.set()
        first_go.wait(60)

    def second(event):
        second_started.set()
        second_go.wait(60)
        raise RuntimeError("the second run fails: the event is to be retried")

    late = worker_running(db, first)
    with Running(late):
        emit("ns", "h", {"n": 1}, db=db)
        wait_until(first_started.is_set, what="the first worker's run")
        with db.connection() as conn:  # its lock expires (as after a stop or a partition longer than lock_expiry)
            conn.execute("UPDATE eventqueue_events SET visible_at = now() - interval '1 second'")
        with Running(worker_running(db, second)):
            wait_until(second_started.is_set, what="the second worker's run of the lapsed event")
            first_go.set()
            wait_until(lambda: not late._held, what="the first worker done with the event")
            second_go.set()

            def retried() -> bool:
                with db.connection() as conn:
                    row = conn.execute("SELECT retries, locked_at FROM eventqueue_events").fetchone()
                assert row is not None, "the event was deleted under the worker that claimed it since"
                return row[0] == 1 and row[1] is None

            wait_until(retried, what="the event retried after the second run failed")


def test_a_renewal_that_finds_the_lock_taken_forgets_the_event(db):
    go = threading.Event()
    worker = worker_running(db, lambda event: go.wait(60))
    emit("ns", "h", {"n": 1}, db=db)
    assert worker._fill()[0] == 1
    [item] = worker._held.values()
    with db.connection() as conn:  # another worker's claim since (as after a stop longer than lock_expiry)
        conn.execute("UPDATE eventqueue_events SET locked_at = clock_timestamp()")
    item.renewed_at -= item.handler.config.lock_expiry / 2  # its renewal is due
    worker._renew_locks()
    assert not worker._held, "the event is still counted as this worker's"
    go.set()
    assert worker.executor.wait_all(10)
    worker._settle_ended()
    worker._flush()
    with db.connection() as conn:
        assert conn.execute("SELECT count(*) FROM eventqueue_events").fetchone()[0] == 1, "deleted under its new claim"
