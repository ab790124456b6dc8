"""A worker whose claim lapsed while its handler ran (a stopped process, a host cut off past the lock's expiry)
leaves the event to the worker that claimed it since: finishing does not delete it under that worker."""

import threading

from running import Running
from waiting import wait_until

from cmb_dagster.eventqueue import EventQueueOptions, EventWorker, HandlerRegistry, WorkerSettings, emit

FAST = WorkerSettings(sweep_interval=0.2)


def worker_running(db, handler, lock_expiry: float = 60) -> EventWorker:
    registry = HandlerRegistry()
    registry.add("h", handler, lock_expiry=lock_expiry)
    worker = EventWorker(db, EventQueueOptions(handlers=registry, worker=FAST))
    worker.register()
    return worker


def event_row(db, event_id: int) -> tuple | None:
    with db.connection() as conn:
        return conn.execute(
            "SELECT locked_at, visible_at, retries FROM eventqueue_events WHERE id = %s", (event_id,)
        ).fetchone()


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

    with Running(worker_running(db, first)) as late:
        emit("ns", "h", {"n": 1}, db=db)
        wait_until(first_started.is_set, what="the first worker's run")
        with db.connection() as conn:  # its lock expires (as after a stop or a partition longer than lock_expiry)
            conn.execute("UPDATE eventqueue_events SET visible_at = now() - interval '1 second'")
        with Running(worker_running(db, second)):
            wait_until(second_started.is_set, what="the second worker's run of the lapsed event")
            first_go.set()
            late.stop()  # returns once the first worker has written the outcome of its call
            second_go.set()

            def retried() -> bool:
                with db.connection() as conn:
                    row = conn.execute("SELECT retries, locked_at FROM eventqueue_events").fetchone()
                assert row is not None, "the event was deleted under the worker that claimed it since"
                return row[0] == 1 and row[1] is None

            wait_until(retried, what="the event retried after the second run failed")


def test_a_renewal_that_finds_the_lock_taken_leaves_the_event_to_its_new_claim(db, caplog):
    """The worker renews the locks of the events it holds; one whose lock another worker took meanwhile is no longer
    its own: that lock is not extended, and its call failing afterwards neither retries it nor says so."""
    go = threading.Event()

    def hold(event):
        go.wait(60)
        if event.value == "taken over":
            raise RuntimeError("the call fails after its claim was taken over")

    worker = worker_running(db, hold, lock_expiry=1.5)  # a renewal every half second
    taken, kept = (emit("ns", "h", value, db=db) for value in ("taken over", "kept"))
    with Running(worker):
        wait_until(lambda: all(event_row(db, i)[0] for i in (taken, kept)), what="both events claimed")
        with db.connection() as conn:  # another worker's claim since, for an hour (as after a long stop)
            conn.execute(
                "UPDATE eventqueue_events SET locked_at = clock_timestamp(), visible_at = now() + interval '1 hour' "
                "WHERE id = %s",
                (taken,),
            )
        new_claim = event_row(db, taken)
        kept_until = event_row(db, kept)[1]
        wait_until(lambda: event_row(db, kept)[1] > kept_until, what="a renewal of the locks the worker holds")
        go.set()
        wait_until(lambda: event_row(db, kept) is None, what="the event still held done")
    assert event_row(db, taken) == new_claim, "the worker acted on an event another worker claimed"
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"event {taken} ")]
    assert not told, "the worker reported a retry of an event it no longer held"
