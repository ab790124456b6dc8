"""Poison events: a handler that keeps failing on one event has it parked (or, with on_poison="stop", stops on
it and says so), the other events arrive once, and replay runs the parked ones again."""

import asyncio
import logging

import pytest
from running import Running
from waiting import wait_until

from cmb_dagster.pubsub import (
    ConsumerSpec,
    ConsumerWorker,
    HandlerFailed,
    dead_letters,
    publish,
    replay,
    status,
)

POISON = {3, 7}


def worker(db, consumer_id, handler, **options):
    return ConsumerWorker(db, ConsumerSpec(consumer_id=consumer_id, handler=handler, **options))


def count(db, query, params=None):
    with db.connection() as conn:
        return conn.execute(query, params).fetchone()[0]


def results(db):
    with db.connection() as conn:
        return [r[0] for r in conn.execute("SELECT n FROM public.results ORDER BY n")]


def parked(db, *args, **kwargs):
    with db.connection() as conn:
        return dead_letters(conn, *args, **kwargs)


def poisoned_handler(conn, events):
    """Writes each event's n; raises on the poison ones (after writing: the rollback must undo it)."""
    conn.execute("INSERT INTO public.results SELECT unnest(%s::int[])", ([e.payload["n"] for e in events],))
    bad = [e.payload["n"] for e in events if e.payload["n"] in POISON]
    if bad:
        raise ValueError(f"poison {bad[0]}")


def fixed_handler(conn, events):
    conn.execute("INSERT INTO public.results SELECT unnest(%s::int[])", ([e.payload["n"] for e in events],))


def run_until_idle(consumer, limit=200):
    """run_once until a call delivers nothing and raises nothing; return the HandlerFailed messages."""
    failures = []
    for _ in range(limit):
        try:
            if consumer.run_once() == 0:
                return failures
        except HandlerFailed as exc:
            failures.append(str(exc))
    raise AssertionError(f"still busy after {limit} batches: {failures[-3:]}")


def run_until_idle_or_failing(consumer):
    for _ in range(20):
        try:
            if consumer.run_once() == 0:
                return
        except HandlerFailed as exc:
            if "attempt" in str(exc):
                return


@pytest.fixture
def ten_events(db):
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.results (n int NOT NULL)")
        return [publish(0, {"n": n}, conn=conn) for n in range(10)]


def test_a_poison_event_is_parked_after_max_attempts_and_the_good_ones_arrive_once(db, ten_events, caplog):
    consumer = worker(db, "tolerant", poisoned_handler, batch_size=4, max_attempts=3)
    with caplog.at_level(logging.WARNING, logger="cmb_dagster.pubsub"):
        failures = run_until_idle(consumer)
    assert results(db) == [n for n in range(10) if n not in POISON]  # each good one exactly once
    assert sum("attempt" in f for f in failures) == 2 * 2  # attempts 1 and 2 of each; the 3rd parks it
    letters = parked(db)
    assert [(d.event.id, d.attempts, d.error) for d in letters] == [
        (ten_events[3], 3, "ValueError: poison 3"),
        (ten_events[7], 3, "ValueError: poison 7"),
    ]
    assert "raise ValueError" in letters[0].traceback and letters[0].event.payload == {"n": 3}
    assert sum("parked event" in r.getMessage() for r in caplog.records) == 2
    [lag] = status(db, "tolerant").consumers
    assert (lag.delivered, lag.events, lag.parked, lag.failing_event) == (8, 0, 2, None)
    assert "2 parked event(s)" in lag.problem

    assert replay(db, "tolerant", 0, poisoned_handler) == (0, 2)  # still poisonous: both stay parked
    assert [d.attempts for d in parked(db, "tolerant")] == [4, 4]
    assert replay(db, "tolerant", 0, fixed_handler, event_ids=[ten_events[7]]) == (1, 0)
    assert replay(db, "tolerant", 0, fixed_handler) == (1, 0)
    assert replay(db, "tolerant", 0, fixed_handler) == (0, 0)  # exactly once
    assert results(db) == list(range(10))
    assert parked(db) == [] and len(parked(db, include_replayed=True)) == 2


def test_an_async_handler_has_its_poison_events_parked_and_replayed(db, ten_events):
    async def poisoned(conn, events):
        poisoned_handler(conn, events)

    async def fixed(conn, events):
        await asyncio.sleep(0)
        fixed_handler(conn, events)

    run_until_idle(worker(db, "async", poisoned, batch_size=4, max_attempts=2))
    assert results(db) == [n for n in range(10) if n not in POISON]
    assert [d.event.id for d in parked(db, "async")] == [ten_events[3], ten_events[7]]
    assert replay(db, "async", 0, fixed) == (2, 0)
    assert results(db) == list(range(10))


def test_with_on_poison_stop_nothing_after_the_poison_event_is_delivered_and_status_says_why(db, ten_events, caplog):
    consumer = worker(db, "strict", poisoned_handler, batch_size=4, max_attempts=2, on_poison="stop")
    with caplog.at_level(logging.ERROR, logger="cmb_dagster.pubsub"):
        for _ in range(5):
            run_until_idle_or_failing(consumer)
    assert results(db) == [0, 1, 2]
    pubsub = status(db, "strict")
    [lag] = pubsub.consumers
    assert (lag.failing_event, lag.delivered, lag.events, lag.parked) == (ten_events[3], 3, 7, 0)
    assert (pubsub.behind, pubsub.parked, pubsub.stuck) == (7, 0, 1)
    stuck = f"stuck on event {ten_events[3]} after {lag.attempts} failed attempts: ValueError: poison 3"
    assert lag.attempts >= 5 and stuck in lag.problem
    assert any("stuck on event" in r.getMessage() and "on_poison='stop'" in r.getMessage() for r in caplog.records)
    assert parked(db) == []


def test_the_worker_parks_a_poison_event_by_itself_and_goes_on(db, ten_events):
    # backoff 0.1 s after each failure: two poison events, two attempts each
    consumer = worker(
        db, "worker", poisoned_handler, max_attempts=2, idle_sleep=0.05, backoff={"first": 0.1, "factor": 2, "max": 1}
    )
    with Running(consumer) as running:
        wait_until(
            lambda: len(results(db)) == 8 and count(db, "SELECT count(*) FROM pubsub_dead_letters") == 2,
            timeout=30,
            what="both poison events parked, the rest delivered",
        )
    assert results(db) == [n for n in range(10) if n not in POISON]
    assert running.report.errors >= 2  # each failed attempt is a failed step, retried after the backoff
