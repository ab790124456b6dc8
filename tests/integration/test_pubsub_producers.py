"""What producers' writes do besides the events: one commit hint per transaction that wakes an idle consumer,
and a refusal while the stream's txids come from another cluster."""

import psycopg
import pytest
from running import Running
from waiting import wait_until

from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker, StreamRestored, publish


def worker(db, consumer_id, handler, **options):
    return ConsumerWorker(db, ConsumerSpec(consumer_id=consumer_id, handler=handler, **options))


def count(db, query, params=None):
    with db.connection() as conn:
        return conn.execute(query, params).fetchone()[0]


def test_a_commit_wakes_an_idle_consumer_at_once_with_one_notification_per_transaction(db):
    with db.connect(autocommit=True) as listener:
        listener.execute(f'LISTEN "{db.schema}.pubsub"')
        with db.connection() as conn:
            for n in range(3):
                publish(0, {"n": n}, conn=conn)
            conn.execute(
                "INSERT INTO pubsub_events (branch_id, topic, op, payload) SELECT 1, 't', 'publish', '{}'"
                " FROM generate_series(1, 5)"
            )
        notes = list(listener.notifies(timeout=1.0, stop_after=10))
        assert [(n.channel, n.payload) for n in notes] == [(f"{db.schema}.pubsub", "")]

    seen = []
    consumer = worker(db, "sleepy", lambda conn, events: seen.extend(events), idle_sleep=60)
    with Running(consumer):
        wait_until(lambda: len(seen) == 3, what="the backlog delivered")
        wait_until(
            lambda: count(db, "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN%%'"),
            what="the consumer listens",
        )
        with db.connection() as conn:
            publish(0, {"n": "hint"}, conn=conn)
        wait_until(lambda: len(seen) == 4, timeout=20, what="the hint wakes the consumer well before its 60 s poll")


def test_publish_refuses_while_the_stream_is_from_another_cluster(db):
    with db.connection() as conn:
        conn.execute("UPDATE pubsub_clock SET system_identifier = 42")
    with db.connection() as conn, pytest.raises(StreamRestored, match="cmb-dagster pubsub reset"):
        publish(0, {"n": 1}, conn=conn)
    refused = pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="another Postgres cluster")
    with db.connection() as conn, refused:
        conn.execute("INSERT INTO pubsub_events (branch_id, topic, op, payload) VALUES (0, 't', 'publish', '{}')")
    assert count(db, "SELECT count(*) FROM pubsub_events") == 0
