"""Issue 11: poison events, strict txid order, retention and start positions, commit hints."""

import logging
import random
import threading
import time
from datetime import timedelta

import psycopg
import pytest
from waiting import wait_until

from cmb_dagster.pubsub import (
    Consumer,
    HandlerFailed,
    consumer_lag,
    dead_letters,
    publish,
    replay,
    trim,
)

POISON = {3, 7}


def count(db, query, params=None):
    with db.connection() as conn:
        return conn.execute(query, params).fetchone()[0]


def results(db):
    with db.connection() as conn:
        return [r[0] for r in conn.execute("SELECT n FROM public.results ORDER BY n")]


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


@pytest.fixture
def ten_events(db):
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.results (n int NOT NULL)")
        return [publish(conn, 0, {"n": n}) for n in range(10)]


def test_a_poison_event_is_parked_after_max_attempts_and_the_good_ones_arrive_once(db, ten_events, caplog):
    consumer = Consumer(db, "tolerant", 0, poisoned_handler, batch_size=4, max_attempts=3)
    with caplog.at_level(logging.WARNING, logger="cmb_dagster.pubsub"):
        failures = run_until_idle(consumer)
    assert results(db) == [n for n in range(10) if n not in POISON]  # each good one exactly once
    assert sum("attempt" in f for f in failures) == 2 * 2  # attempts 1 and 2 of each; the 3rd parks it
    parked = dead_letters(_conn(db))
    assert [(d.event.id, d.attempts, d.error) for d in parked] == [
        (ten_events[3], 3, "ValueError: poison 3"), (ten_events[7], 3, "ValueError: poison 7")]
    assert "raise ValueError" in parked[0].traceback and parked[0].event.payload == {"n": 3}
    assert sum("parked event" in r.getMessage() for r in caplog.records) == 2
    [lag] = consumer_lag(_conn(db), "tolerant")
    assert (lag.delivered, lag.events, lag.parked, lag.failing_event) == (8, 0, 2, None)
    assert "2 parked event(s)" in lag.problem

    assert replay(db, "tolerant", 0, poisoned_handler) == (0, 2)  # still poisonous: both stay parked
    assert [d.attempts for d in dead_letters(_conn(db), "tolerant")] == [4, 4]
    assert replay(db, "tolerant", 0, fixed_handler, event_ids=[ten_events[7]]) == (1, 0)
    assert replay(db, "tolerant", 0, fixed_handler) == (1, 0)
    assert replay(db, "tolerant", 0, fixed_handler) == (0, 0)  # exactly once
    assert results(db) == list(range(10))
    assert dead_letters(_conn(db)) == [] and len(dead_letters(_conn(db), include_replayed=True)) == 2


def _conn(db):
    """An autocommit connection closed with the test (for read-only helpers)."""
    conn = db.connect(autocommit=True)
    _OPEN.append(conn)
    return conn


_OPEN: list = []


@pytest.fixture(autouse=True)
def _close_connections():
    yield
    while _OPEN:
        _OPEN.pop().close()


def test_with_on_poison_stop_nothing_after_the_poison_event_is_delivered_and_status_says_why(db, ten_events, caplog):
    consumer = Consumer(db, "strict", 0, poisoned_handler, batch_size=4, max_attempts=2, on_poison="stop")
    with caplog.at_level(logging.ERROR, logger="cmb_dagster.pubsub"):
        for _ in range(5):
            run_until_idle_or_failing(consumer)
    assert results(db) == [0, 1, 2]
    [lag] = consumer_lag(_conn(db), "strict")
    assert (lag.failing_event, lag.delivered, lag.events, lag.parked) == (ten_events[3], 3, 7, 0)
    assert lag.attempts >= 5 and f"stuck on event {ten_events[3]} after {lag.attempts} failed attempts: ValueError: poison 3" in lag.problem
    assert any("stuck on event" in r.getMessage() and "on_poison='stop'" in r.getMessage() for r in caplog.records)
    assert dead_letters(_conn(db)) == []


def run_until_idle_or_failing(consumer):
    for _ in range(20):
        try:
            if consumer.run_once() == 0:
                return
        except HandlerFailed as exc:
            if "attempt" in str(exc):
                return


def test_the_worker_parks_a_poison_event_by_itself_and_goes_on(db, ten_events):
    consumer = Consumer(db, "worker", 0, poisoned_handler, max_attempts=2, idle_sleep=0.05)
    thread = threading.Thread(target=consumer.run, args=(60,))
    thread.start()
    try:  # backoff 0.5 s after each failure: two poison events, two attempts each
        wait_until(lambda: len(results(db)) == 8 and count(db, "SELECT count(*) FROM pubsub_dead_letters") == 2,
                   timeout=30, what="both poison events parked, the rest delivered")
    finally:
        consumer.stop()
        thread.join(10)
    assert results(db) == [n for n in range(10) if n not in POISON]


def test_order_txid_delivers_in_txid_order_under_interleaved_long_and_short_transactions(db):
    committed: list[int] = []
    lock = threading.Lock()

    def produce(seed):
        r = random.Random(seed)
        with db.connect() as conn:
            for _ in range(15):
                ids = [publish(conn, 0, {"p": seed})]
                time.sleep(r.choice([0, 0, 0.002, 0.01, 0.04]))  # long and short transactions interleave
                ids.append(publish(conn, 0, {"p": seed}))
                conn.commit()
                with lock:
                    committed.extend(ids)

    delivered: list[tuple[int, int]] = []
    consumer = Consumer(db, "strict-order", 0, lambda conn, events: delivered.extend((e.txid, e.id) for e in events),
                        batch_size=7, order="txid")
    producers = [threading.Thread(target=produce, args=(seed,)) for seed in range(4)]
    for p in producers:
        p.start()
    while any(p.is_alive() for p in producers):
        consumer.run_once()
    for p in producers:
        p.join()
    # Any transaction of the cluster still running (another database's too) holds strict order back.
    wait_until(lambda: consumer.run_once() == 0 and len(delivered) >= len(committed), what="everything delivered")
    assert delivered == sorted(delivered)  # txid order, a transaction's events in id order
    assert sorted(i for _, i in delivered) == sorted(committed)  # nothing skipped, nothing twice


def test_order_txid_waits_for_an_older_open_transaction_of_this_database_only(db, server_url):
    delivered = []
    strict = Consumer(db, "strict", 0, lambda conn, events: delivered.extend(e.id for e in events), order="txid")
    loose = Consumer(db, "loose", 0, lambda conn, events: None)
    elsewhere = psycopg.connect(server_url)  # a writer in another database of the cluster: no events here
    elsewhere.execute("SELECT pg_current_xact_id()")
    with db.connection() as conn:
        before = publish(conn, 0, {"n": "while another database writes"})
    wait_until(lambda: strict.run_once() == 0 and delivered == [before], what="not held back by another database")
    elsewhere.rollback()
    elsewhere.close()
    delivered.clear()
    older = db.connect()
    first = publish(older, 0, {"n": "older, still open"})
    with db.connection() as conn:
        second = publish(conn, 0, {"n": "younger, committed"})
    assert strict.run_once() == 0  # the younger one waits for the older transaction
    assert loose.run_once() == 2  # the default mode delivers it at once
    older.commit()
    older.close()
    wait_until(lambda: strict.run_once() == 0 and len(delivered) == 2, what="both delivered")
    assert delivered == [first, second]


def test_trim_keeps_events_younger_than_retain_and_late_consumers_choose_where_to_start(db, caplog):
    with db.connection() as conn:
        old = [publish(conn, 0, {"n": n}) for n in range(3)]
    first = Consumer(db, "first", 0, lambda conn, events: None)
    assert first.run_once() == 3
    with db.connect(autocommit=True) as conn:
        assert trim(conn) == 0  # read by every consumer, but younger than 7 days
        conn.execute("UPDATE cmb.pubsub_events SET created_at = created_at - interval '8 days' WHERE id = ANY (%s)",
                     (old[:2],))
        assert trim(conn) == 2  # the week-old ones go
    with db.connection() as conn:
        new = publish(conn, 0, {"n": 3})

    seen = {}
    for start in ("beginning", "earliest_kept", "now"):
        seen[start] = []
        consumer = Consumer(db, f"late-{start}", 0, lambda conn, events, s=start: seen[s].extend(e.id for e in events),
                            start=start)
        with caplog.at_level(logging.WARNING, logger="cmb_dagster.pubsub"):
            consumer.check()
            consumer.check()
    with db.connection() as conn:
        publish(conn, 0, {"n": 4})
    for start in seen:
        Consumer(db, f"late-{start}", 0, lambda conn, events, s=start: seen[s].extend(e.id for e in events)).run_once()
    assert seen["beginning"][:2] == [old[2], new] and seen["earliest_kept"][:2] == [old[2], new]
    assert len(seen["now"]) == 1 and seen["now"][0] > new
    warnings = [r.getMessage() for r in caplog.records if "trim had already deleted 2 of its events" in r.getMessage()]
    assert len(warnings) == 1 and "late-beginning" in warnings[0]  # once, and only for start="beginning"
    lags = {lag.consumer_id: lag for lag in consumer_lag(_conn(db))}
    assert "trim had already deleted 2" in lags["late-beginning"].problem
    assert lags["late-earliest_kept"].problem is None and lags["late-now"].problem is None


def test_a_commit_wakes_an_idle_consumer_at_once_with_one_notification_per_transaction(db):
    with db.connect(autocommit=True) as listener:
        listener.execute(f'LISTEN "{db.schema}.pubsub"')
        with db.connection() as conn:
            for n in range(3):
                publish(conn, 0, {"n": n})
            conn.execute("INSERT INTO pubsub_events (branch_id, topic, op, payload) SELECT 1, 't', 'publish', '{}'"
                         " FROM generate_series(1, 5)")
        notes = list(listener.notifies(timeout=1.0, stop_after=10))
        assert [(n.channel, n.payload) for n in notes] == [(f"{db.schema}.pubsub", "")]

    seen = []
    consumer = Consumer(db, "sleepy", 0, lambda conn, events: seen.extend(events), idle_sleep=60)
    thread = threading.Thread(target=consumer.run)
    thread.start()
    try:
        wait_until(lambda: len(seen) == 3, what="the backlog delivered")
        wait_until(lambda: count(db, "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN%%'"),
                   what="the consumer listens")
        with db.connection() as conn:
            publish(conn, 0, {"n": "hint"})
        wait_until(lambda: len(seen) == 4, timeout=20, what="the hint wakes the consumer well before its 60 s poll")
    finally:
        consumer.stop()
        thread.join(10)


def test_publish_refuses_while_the_stream_is_from_another_cluster(db):
    with db.connection() as conn:
        conn.execute("UPDATE pubsub_clock SET system_identifier = 42")
    with db.connection() as conn, pytest.raises(Exception, match="cmb-dagster pubsub reset"):
        publish(conn, 0, {"n": 1})
    with db.connection() as conn, pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="another Postgres cluster"):
        conn.execute("INSERT INTO pubsub_events (branch_id, topic, op, payload) VALUES (0, 't', 'publish', '{}')")
    assert count(db, "SELECT count(*) FROM pubsub_events") == 0
